"""vLLM's extra sampling fields on the offline engine (min_tokens, include_stop_str_in_output,
allowed_token_ids, bad_words, truncate_prompt_tokens), the sampler's bans and state, the chat
template's options, and the API's request models refusing mistyped fields."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoTokenizer

import shardserve.core
import shardserve.sampling_params
from shardserve.chat_messages import render_chat
from shardserve.core import Request
from shardserve.engine.sampler import banned_tokens
from shardserve.llm import LLM
from shardserve.sampling_params import SamplingParams
from shardserve.server.protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(model=tiny_model("llama")[0], show_progress=False, num_pages=512)


def greedy(llm: LLM, prompt=PROMPT, **kw):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, **kw), use_tqdm=False)[0]


def test_core_imports_nothing_from_the_engine() -> None:
    for module in (shardserve.core, shardserve.sampling_params):
        tree = ast.parse(pathlib.Path(module.__file__).read_text())
        modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in modules if m and m.startswith("shardserve.engine")], module.__name__
    assert "penalty_state" not in Request.__dataclass_fields__


def test_the_sampler_forgets_a_finished_requests_penalty_state(llm: LLM) -> None:
    sp = SamplingParams(temperature=0.5, max_tokens=3, repetition_penalty=1.2)
    states = llm.engine.worker.sampler.penalties
    first = llm.generate([PROMPT], sp, use_tqdm=False)[0].request_id
    assert first in states  # made on its first penalised step
    second = llm.generate([PROMPT], sp, use_tqdm=False)[0].request_id
    assert first not in states and second in states  # the next plan's `done` dropped it


def test_banned_tokens_follow_vllms_rules() -> None:
    def req(out: list[int], **kw) -> Request:
        r = Request("r", [1], SamplingParams(**kw), eos_token_ids=(9,))
        for t in out:
            r.append_token(t)
        return r

    def banned(r: Request) -> list[int]:
        mask = banned_tokens(r, 10, torch.device("cpu"))
        return [] if mask is None else mask.nonzero().flatten().tolist()

    assert banned(req([], min_tokens=2, stop_token_ids=[4])) == [4, 9]
    assert banned(req([5, 6], min_tokens=2, stop_token_ids=[4])) == []
    assert banned(req([], min_tokens=2, ignore_eos=True)) == []
    bad = {"bad_words_token_ids": [[3], [5, 6, 7]]}
    assert banned(req([1, 5, 6], **bad)) == [3, 7]  # the output ends in 5 6: 7 would finish the word
    assert banned(req([5, 1], **bad)) == [3]
    assert banned(req([], allowed_token_ids=[2, 4, 99])) == [0, 1, 3, 5, 6, 7, 8, 9]
    assert banned(req([], allowed_token_ids=[3], **bad)) == []  # all banned: ban nothing, never fail


def test_min_tokens_holds_off_stop_tokens(llm: LLM) -> None:
    base = greedy(llm).token_ids
    stop = base[1]
    assert greedy(llm, stop_token_ids=[stop]).token_ids == base[:2]
    held = greedy(llm, stop_token_ids=[stop], min_tokens=5)
    assert len(held.token_ids) >= 5 and stop not in held.token_ids[:5]
    assert held.finish_reason == "length" or held.token_ids[-1] == stop


def test_min_tokens_holds_off_stop_strings_and_the_stop_string_may_stay(llm: LLM) -> None:
    base = greedy(llm)
    word = llm.tokenizer.decode(base.token_ids[1:2])  # the second token's text
    cut = greedy(llm, stop=[word])
    assert cut.finish_reason == "stop" and word not in cut.text
    kept = greedy(llm, stop=[word], include_stop_str_in_output=True)
    assert kept.text == cut.text + word and kept.outputs[0].stop_reason == word
    late = greedy(llm, stop=[word], min_tokens=6)
    assert len(late.token_ids) >= 6 and word in late.text


def test_allowed_token_ids(llm: LLM) -> None:
    allowed = [33, 42, 89]
    for sp in (SamplingParams(temperature=0, max_tokens=10, allowed_token_ids=allowed),
               SamplingParams(temperature=1.0, seed=3, max_tokens=10, allowed_token_ids=allowed)):
        out = llm.generate([PROMPT], sp, use_tqdm=False)[0].token_ids
        assert len(out) == 10 and set(out) <= set(allowed)


def test_bad_words_ban_a_words_last_token_after_the_rest(llm: LLM) -> None:
    base = greedy(llm).token_ids
    two = llm.tokenizer.decode(base[1:3])  # a two-token word the model would say
    assert llm.tokenizer.encode(two, add_special_tokens=False) == base[1:3]
    out = greedy(llm, bad_words=[two]).token_ids
    assert out[:2] == base[:2] and out[2] != base[2]  # its first token is fine; what would finish it is not
    one = llm.tokenizer.decode(base[1:2])
    assert base[1] not in greedy(llm, bad_words=[one]).token_ids


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    ids = llm.tokenizer.encode(PROMPT)
    cut = greedy(llm, truncate_prompt_tokens=3)
    assert cut.prompt_token_ids == ids[-3:]
    assert cut.token_ids == greedy(llm, ids[-3:]).token_ids != greedy(llm).token_ids


@pytest.mark.parametrize(("kw", "field"), [
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_new_sampling_fields_are_checked(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**kw)


def test_chat_template_options(tiny_model) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model("llama")[0])
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    assert render_chat(tok, msgs).endswith("Hel<|im_end|>\n<|im_start|>assistant\n")
    assert render_chat(tok, msgs, options={"add_generation_prompt": False}).endswith("Hel<|im_end|>\n")
    cont = render_chat(tok, msgs, options={"add_generation_prompt": False, "continue_final_message": True})
    assert cont.endswith("assistant\nHel")
    own = "{% for m in messages %}[{{ m.content }}]{% endfor %}{% if enable_thinking %}<think>{% endif %}"
    assert render_chat(tok, msgs, options={"chat_template": own}) == "[Hi][Hel]"
    thinking = render_chat(tok, msgs, options={"chat_template": own, "chat_template_kwargs": {"enable_thinking": True}})
    assert thinking == "[Hi][Hel]<think>"


MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(("model", "body", "field"), [
    (CompletionRequest, {"prompt": "x", "temperature": True}, "temperature"),
    (CompletionRequest, {"prompt": "x", "n": True}, "n"),
    (CompletionRequest, {"prompt": "x", "seed": True}, "seed"),
    (CompletionRequest, {"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    (CompletionRequest, {"prompt": "x", "echo": 0}, "echo"),
    (CompletionRequest, {"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    (CompletionRequest, {"prompt": [1, True]}, "prompt"),
    (ChatRequest, {"messages": MESSAGES, "logprobs": 1}, "logprobs"),
    (ChatRequest, {"messages": MESSAGES, "stream_options": {"include_usage": 1}}, "stream_options"),
    (ChatRequest, {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    (TokenizeRequest, {"prompt": "x", "add_special_tokens": 0}, "add_special_tokens"),
    (DetokenizeRequest, {"tokens": [1, 2.0]}, "tokens"),
])
def test_request_models_are_strict(model, body: dict, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    assert e.value.errors()[0]["loc"][0] == field


def test_an_integer_is_a_fine_float() -> None:
    body = CompletionRequest.model_validate({"prompt": "x", "temperature": 1, "top_p": 1, "logit_bias": {"5": 2}})
    assert (body.temperature, body.top_p, body.logit_bias) == (1.0, 1.0, {"5": 2.0})
