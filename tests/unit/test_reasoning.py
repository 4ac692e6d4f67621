"""Reasoning parsers: the thinking split off the answer, whole and streamed alike, and structured outputs
that hold after the thinking."""

from __future__ import annotations

import pytest

from shardserve.sampling_params import SamplingParams
from shardserve.server.reasoning import Reasoning
from shardserve.structured_outputs import StructuredOutputsParams

CASES = [  # parser, template opens <think>, output -> (reasoning, answer)
    ("qwen3", False, "<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "Paris.")),
    ("qwen3", False, "Paris, no thinking. </think> stays", (None, "Paris, no thinking. </think> stays")),
    ("qwen3", False, "  <think>cut off", ("cut off", "")),
    ("qwen3", False, "<thin", (None, "<thin")),
    ("qwen3", True, "Hmm.</think>Paris.", ("Hmm.", "Paris.")),
    ("qwen3", True, "<think>Hmm.</think>Paris.", ("Hmm.", "Paris.")),
    ("deepseek_r1", False, "Let me see</think>\n\nParis.", ("Let me see", "Paris.")),
    ("deepseek_r1", False, "still thinking </thi", ("still thinking </thi", "")),
    ("deepseek_r1", False, "<think>a</think>b</think>c", ("a", "b</think>c")),
    (None, False, "<think>a</think>b", (None, "<think>a</think>b")),
    ("deepseek_r1", False, "</think>\n\nNo thought.", (None, "No thought.")),  # empty: none, whole or streamed
    ("qwen3", False, "   ", (None, "   ")),
]


@pytest.mark.parametrize("name,opens,text,want", CASES)
def test_split_whole_and_streamed(name, opens, text, want):
    parser = Reasoning(name, opens)
    assert parser.parse(text) == want
    for step in (1, 2, 3, 7):  # any split of the text streams to the same parts
        s = parser.stream()
        parts = [p for i in range(0, len(text), step) for p in s.feed(text[i:i + step])] + s.feed("", final=True)
        reasoning = "".join(t for k, t in parts if k == "reasoning")
        assert (reasoning or None, "".join(t for k, t in parts if k == "content")) == want
        if want[0]:  # what may be a tag is held back, never streamed as the wrong kind
            assert all("</think>" not in t and "<think>" not in t for k, t in parts if k == "reasoning")


def test_prompt_end_tells_whether_the_template_opens_thinking():
    assert Reasoning.of("qwen3", "<|im_start|>assistant\n<think>\n").opened
    assert not Reasoning.of("qwen3", "<|im_start|>assistant\n").opened
    assert not Reasoning.of("qwen3", "assistant\n<think>\n\n</think>\n\n").opened  # enable_thinking: false
    assert Reasoning.of("deepseek_r1", "<｜Assistant｜>").opened
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        Reasoning("o1")


def test_structured_outputs_hold_after_the_thinking(tiny_tok):
    """The spec constrains the answer; the thinking before `</think>` runs free."""
    import llguidance.hf
    from llguidance import LLMatcher

    from shardserve.structured_outputs import grammar_of

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    assert Reasoning().constrain(params) is params
    lltok = llguidance.hf.from_tokenizer(tiny_tok, n_vocab=len(tiny_tok))

    def accepts(parser: Reasoning, text: str) -> bool:
        spec = parser.constrain(params).structured_outputs
        m = LLMatcher(lltok, grammar_of(*spec.key()), log_level=0)
        return all(m.consume_token(t) for t in tiny_tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    opened, hybrid = Reasoning("deepseek_r1"), Reasoning("qwen3")
    assert accepts(opened, 'What is a? It is {"b": 2}, no: one.</think>{"a": 1}')
    assert not accepts(opened, '{"a": 1}')  # still thinking: the answer has not begun
    assert not accepts(opened, 'Fine.</think>Not JSON')
    assert accepts(hybrid, '<think>hmm</think>{"a": 1}') and accepts(hybrid, '{"a": 1}')
    assert not accepts(hybrid, 'hmm</think>{"a": 1}')
    with pytest.raises(ValueError, match="thinking must be None, 'opened' or 'optional'"):
        StructuredOutputsParams(json=schema, thinking="sometimes")


def test_thinking_tags_that_are_tokens(tmp_path):
    """Where <think> and </think> are tokens of their own (Qwen3, R1), llguidance keeps them out of text, so the
    tokenizer worker has the grammar name them as tokens; the same spec then holds after them."""
    import llguidance.hf
    from llguidance import LLMatcher
    from scripted_model import THINK_TAGS
    from tiny_tokenizer import save_tiny_tokenizer
    from transformers import AutoTokenizer

    from shardserve.ipc.messages.api import GenerateReq
    from shardserve.structured_outputs import grammar_of
    from shardserve.tokenizer.worker import Tokenizer

    save_tiny_tokenizer(str(tmp_path), 301, added=THINK_TAGS)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    worker = Tokenizer(tok, None, None)
    assert worker.think_tokens
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    spec = StructuredOutputsParams(json={"type": "object"}, thinking="opened")
    params = SamplingParams(structured_outputs=spec)
    sent = worker.tokenized(GenerateReq(rid="r", params=params, text="hi")).params.structured_outputs
    assert sent.thinking_tokens and sent.key()[2] == "opened-tokens"
    end = tok.convert_tokens_to_ids("</think>")
    for form, ok in ((sent, True), (spec, False)):  # the text form never sees the </think> token
        m = LLMatcher(lltok, grammar_of(*form.key()), log_level=0)
        ids = tok.encode("Rome?", add_special_tokens=False) + [end] + tok.encode('{"a": 1}', add_special_tokens=False)
        assert (all(m.consume_token(t) for t in ids) and m.is_accepting()) == ok
