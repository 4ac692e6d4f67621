"""Prompt logprobs (vLLM's `prompt_logprobs`) equal log-softmax of transformers' logits for every
prompt token after the first, through chunked prefill, preemption and a warm prefix cache."""

from __future__ import annotations

import pytest
import torch

from shardserve.config import EngineConfig
from shardserve.sampling_params import SamplingParams
from shardserve.scheduler.engine_core import EngineCore


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    return lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1), lp[:-1]


def run(core: EngineCore, prompts: list[list[int]], k: int):
    params = SamplingParams(max_tokens=16, temperature=0, prompt_logprobs=k)
    reqs = [core.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while core.has_unfinished():
        core.step()
    return reqs


@pytest.mark.parametrize("cfg", [{}, {"max_num_batched_tokens": 7}, {"page_size": 4, "num_pages": 16}],
                         ids=["one-chunk", "chunked", "preempted"])
def test_prompt_logprobs_match_transformers(tiny_model, cfg):
    path, model = tiny_model("llama")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(model.config.vocab_size, (n,), generator=g).tolist() for n in (1, 9, 30, 41)]
    core = EngineCore(EngineConfig(model=path, show_progress=False, **cfg))
    reqs = run(core, prompts, k=3)
    if "num_pages" in cfg:
        assert core.scheduler.num_preemptions > 0
    for p, r in zip(prompts, reqs):
        got = r.prompt_logprobs
        assert len(got) == len(p) and [e["token_id"] for e in got] == p
        assert got[0]["logprob"] is None and got[0]["top_logprobs"] == []
        if len(p) == 1:
            continue
        want, full = hf_prompt_logprobs(model, p)
        torch.testing.assert_close(torch.tensor([e["logprob"] for e in got[1:]]), want, atol=1e-4, rtol=1e-4)
        top_ids = [[i for i, _ in e["top_logprobs"]] for e in got[1:]]
        assert top_ids == full.topk(3, dim=-1).indices.tolist()


def test_prompt_logprobs_skip_the_prefix_cache(tiny_model):
    path, model = tiny_model("qwen3")
    prompt = list(range(3, 43))
    core = EngineCore(EngineConfig(model=path, show_progress=False, page_size=8))
    warm = core.add_request("warm", prompt, SamplingParams(max_tokens=2, temperature=0))
    while core.has_unfinished():
        core.step()
    assert warm.num_cached_tokens == 0
    (r,) = run(core, [prompt], k=0)
    assert r.num_cached_tokens == 0 and len(r.prompt_logprobs) == len(prompt)
    want, _ = hf_prompt_logprobs(model, prompt)
    torch.testing.assert_close(torch.tensor([e["logprob"] for e in r.prompt_logprobs[1:]]), want,
                               atol=1e-4, rtol=1e-4)
    again = core.add_request("plain", prompt, SamplingParams(max_tokens=2, temperature=0))
    while core.has_unfinished():
        core.step()
    assert again.num_cached_tokens == 32  # the cache still serves others (the last token is always recomputed)


def test_offline_api_and_bad_value(tiny_model):
    from shardserve import LLM

    path, model = tiny_model("llama")
    with LLM(path, show_progress=False) as llm:
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))[0]
        assert [e["token_id"] for e in out.prompt_logprobs] == [5, 6, 7, 8]
        assert llm.generate([[5, 6]], SamplingParams(max_tokens=1))[0].prompt_logprobs is None
        two = llm.generate([[5, 6, 7, 8]], SamplingParams(n=2, max_tokens=2, temperature=0, prompt_logprobs=1))[0]
        assert len(two.outputs) == 2 and two.prompt_logprobs == out.prompt_logprobs
    with pytest.raises(ValueError, match="SamplingParams.prompt_logprobs must be None or an integer"):
        SamplingParams(prompt_logprobs=-1)
