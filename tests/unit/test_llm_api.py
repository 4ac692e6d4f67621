"""The offline `LLM` API on the real SmolLM2-135M-Instruct GGUF: chat, generate, stop strings,
prefix caching, request validation, lifecycle, and greedy tokens equal to transformers' on the
same GGUF file.

Loading dominates the runtime (the engine, then transformers' own GGUF loader for the reference),
so both live in module-scoped fixtures.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardserve.core import RequestOutput
from shardserve.llm import LLM
from shardserve.sampling_params import SamplingParams

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def llm(smollm2_path: str) -> LLM:
    return LLM(model=smollm2_path, show_progress=False)


@pytest.fixture(scope="module")
def hf_model(smollm2_hf: torch.nn.Module) -> torch.nn.Module:
    return smollm2_hf


def gen(llm: LLM, prompts, params: SamplingParams | list[SamplingParams] = GREEDY) -> list[RequestOutput]:
    return llm.generate(prompts, params, use_tqdm=False)


# ----------------------------------------------------------------------------- chat


def test_chat_answers(llm: LLM) -> None:
    out = llm.chat(FRANCE, SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)
    assert isinstance(out, RequestOutput)
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its answer with its EOS token
    assert out.prompt_token_ids == llm.render_chat(FRANCE)


def test_chat_list_returns_list(llm: LLM) -> None:
    convs = [FRANCE, [{"role": "user", "content": "What is the capital of Germany?"}]]
    outs = llm.chat(convs, SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)
    assert isinstance(outs, list) and len(outs) == 2
    assert all(isinstance(o, RequestOutput) for o in outs)
    assert "Paris" in outs[0].text and "Berlin" in outs[1].text


def test_chat_template_options_render_as_transformers_does(llm: LLM) -> None:
    tok = llm.tokenizer
    convo = FRANCE + [{"role": "assistant", "content": "The capital"}]
    one = SamplingParams(max_tokens=1, temperature=0)
    cont = llm.chat(convo, one, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    want = tok.apply_chat_template(convo, add_generation_prompt=False, continue_final_message=True, tokenize=False)
    assert cont.prompt_token_ids == tok.encode(want, add_special_tokens=False) and want.endswith("The capital")
    own = "{% for m in messages %}{{ m.content }}{% endfor %}{% if loud %}!{% endif %}"
    out = llm.chat(FRANCE, one, use_tqdm=False, chat_template=own, chat_template_kwargs={"loud": True})
    assert out.prompt_token_ids == tok.encode(FRANCE[0]["content"] + "!", add_special_tokens=False)
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(convo, one, use_tqdm=False, continue_final_message=True)


def test_chat_matches_transformers_on_the_gguf(llm: LLM, hf_model: torch.nn.Module) -> None:
    ids = llm.render_chat(FRANCE)
    assert ids == llm.tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"]
    out = gen(llm, [ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0))[0]
    ref: list[int] = []
    ref_lp: list[float] = []
    step_ids, cache = torch.tensor([ids]), None
    with torch.no_grad():  # plain greedy, straight through EOS like ignore_eos
        for _ in range(16):
            res = hf_model(step_ids, cache=cache, use_cache=True)
            logprobs = torch.log_softmax(res.logits[0, -1].float(), -1)
            ref.append(int(logprobs.argmax()))
            ref_lp.append(float(logprobs[ref[-1]]))
            step_ids, cache = torch.tensor([[ref[-1]]]), res.cache
    assert out.token_ids == ref
    # The engine keeps the GGUF's blocks and rounds activations to 16 bits per block of 32 in
    # products of few rows (layers/csrc/quant_matmul.c): ~3e-5 per product, up to ~2e-3 in a
    # logprob after 30 layers (a prompt answered from the prefix cache recomputes its last tokens
    # that way); transformers multiplies the expanded weights in float32.
    torch.testing.assert_close(torch.tensor([e["logprob"] for e in out.logprobs]), torch.tensor(ref_lp),
                               atol=4e-3, rtol=0)


# ----------------------------------------------------------------------------- generate


def test_mixed_prompts_keep_order(llm: LLM) -> None:
    texts = ["Once upon a time", "The quick brown fox", "def fibonacci(n):"]
    ids = llm.tokenizer.encode(texts[1])
    prompts = [texts[0], ids, texts[2]]
    params = SamplingParams(max_tokens=6, temperature=0)
    alone = [gen(llm, p, params)[0] for p in prompts]
    outs = gen(llm, prompts, params)
    assert len(outs) == 3
    assert [o.prompt for o in outs] == [texts[0], None, texts[2]]
    assert [o.prompt_token_ids for o in outs] == [llm.tokenizer.encode(texts[0]), ids, llm.tokenizer.encode(texts[2])]
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    for o in outs:
        assert isinstance(o.text, str) and o.text
        assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        assert all(isinstance(t, int) for t in o.token_ids)
        assert o.finish_reason == "length"
        assert isinstance(o.num_cached_tokens, int) and o.num_cached_tokens >= 0


def test_single_prompt_forms(llm: LLM) -> None:
    ids = llm.tokenizer.encode("Hello")
    params = SamplingParams(max_tokens=3, temperature=0)
    assert gen(llm, "Hello", params)[0].token_ids == gen(llm, ids, params)[0].token_ids == \
        gen(llm, [ids], params)[0].token_ids


STORY = "Once upon a time"  # greedy: ", the city of Nova Haven was a thriving metropolis, ..."
STORY_PARAMS = SamplingParams(max_tokens=16, temperature=0)


@pytest.fixture(scope="module")
def story(llm: LLM) -> str:
    return gen(llm, STORY, STORY_PARAMS)[0].text


def test_stop_string_cuts_text(llm: LLM, story: str) -> None:
    stop = "metropolis"
    assert stop in story, story  # the greedy continuation this test is built on
    out = gen(llm, STORY, dataclasses.replace(STORY_PARAMS, stop=[stop]))[0]
    assert out.text == story[: story.index(stop)]
    assert out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop
    assert len(out.token_ids) < STORY_PARAMS.max_tokens


def test_earliest_of_several_stop_strings_wins(llm: LLM, story: str) -> None:
    first, later = "city", "thriving"
    assert 0 <= story.index(first) < story.index(later), story
    out = gen(llm, STORY, dataclasses.replace(STORY_PARAMS, stop=[later, first]))[0]
    assert out.text == story[: story.index(first)]
    assert out.outputs[0].stop_reason == first


def test_second_request_hits_prefix_cache(llm: LLM) -> None:
    prompt = "Summarise the following paragraph in one sentence. " + " ".join(
        f"Item number {i} on the list is a small blue box." for i in range(8))
    n = len(llm.tokenizer.encode(prompt))
    page = llm.config.page_size
    params = SamplingParams(max_tokens=8, temperature=0)
    first, second = gen(llm, prompt, params)[0], gen(llm, prompt, params)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens > 0
    assert second.num_cached_tokens == (n - 1) // page * page  # every full page but the last token's
    assert second.token_ids == first.token_ids


# ----------------------------------------------------------------------------- refused requests


def test_prompt_longer_than_context(llm: LLM) -> None:
    assert llm.engine.max_model_len == 8192
    with pytest.raises(ValueError, match=r"8200.*8192"):
        gen(llm, [[100] * 8200], SamplingParams(max_tokens=1))


def test_prompt_plus_max_tokens_over_context(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"8190.*16.*8192"):
        gen(llm, [[100] * 8190], SamplingParams(max_tokens=16))


@pytest.mark.parametrize("prompt", ["", [[]]])
def test_empty_prompt(llm: LLM, prompt) -> None:
    with pytest.raises(ValueError, match="empty"):
        gen(llm, prompt)


def test_bad_request_refuses_whole_batch(llm: LLM) -> None:
    with pytest.raises(ValueError):
        gen(llm, ["Hello", [100] * 8200])
    assert not llm.engine.has_unfinished()
    assert llm.engine.allocator.num_used == 0


def test_out_of_vocab_token(llm: LLM) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        gen(llm, [[1, llm.engine.vocab_size]])


# ----------------------------------------------------------------------------- lifecycle


def test_context_manager_and_shutdown(tiny_model) -> None:
    path, _ = tiny_model("llama")  # a second SmolLM2 load would cost seconds; the lifecycle is the same
    with LLM(model=path, show_progress=False, num_pages=64) as small:
        assert gen(small, [[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids
    with pytest.raises(RuntimeError, match="shut down"):
        gen(small, [[1, 2, 3]])
    with pytest.raises(RuntimeError):
        _ = small.engine
