"""Speculative decoding on every layout that runs it: greedy outputs (and logprobs) equal the same
layout's without speculation, token for token, with n-gram lookup and with a draft model, and the
counters say proposals were both accepted and rejected. Pipeline parallelism is refused (see
tests/unit/test_speculative.py)."""

from __future__ import annotations

import pytest
import torch

from shardserve import LLM, SamplingParams

ENGINE = dict(num_pages=96, page_size=8, show_progress=False)
GREEDY = SamplingParams(max_tokens=40, temperature=0, logprobs=1)
# Every step speculates (the default stops above 4 requests a step) and a repeated single token
# is enough to propose (the default wants 2): the tiny random models repeat little else.
ALWAYS = {"disable_by_batch_size": None}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "ngram_min": 1, **ALWAYS}


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 301, (int(k),), generator=g).tolist() for k in torch.randint(3, 40, (n,), generator=g)]


LAYOUTS = {
    "tp2": ("llama", dict(tp_size=2)),
    "dp2": ("llama", dict(dp_size=2)),
    "cp2": ("llama", dict(cp_size=2)),
    "dp_attention_ep2": ("qwen3_moe", dict(tp_size=2, dp_size=2, enable_dp_attention=True)),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_equals_plain_on_layout(tiny_model, close_draft: str, layout: str) -> None:
    kind, sizes = LAYOUTS[layout]
    path = tiny_model(kind)[0]
    prompts = random_prompts(6)
    with LLM(path, **sizes, **ENGINE) as llm:
        want = llm.generate(prompts, GREEDY, use_tqdm=False)
    specs = [NGRAM] + ([{"model": close_draft, "num_speculative_tokens": 3, **ALWAYS}] if kind == "llama" else [])
    if layout == "tp2":  # the draft sharded like the target too
        specs.append({"model": close_draft, "num_speculative_tokens": 3, "draft_tp": "same", **ALWAYS})
    for spec in specs:
        with LLM(path, **sizes, **ENGINE, speculative_config=spec) as llm:
            got = llm.generate(prompts, GREEDY, use_tqdm=False)
            counts = llm.stats().speculative
            if layout == "tp2" and "model" in spec:  # a sharded draft's collectives, on every rank
                drafts = [r["groups"].get("draft", {}) for r in llm.rank_reports()]
                sharded = spec.get("draft_tp") == "same"
                assert all(bool(d.get("all_reduce", {}).get("calls")) == sharded for d in drafts), drafts
        assert [o.token_ids for o in got] == [o.token_ids for o in want], spec
        if layout == "cp2":  # a verified chunk attends by the ring, not the decode kernel: not bit for bit
            diff = max(abs(a["logprob"] - b["logprob"]) for x, y in zip(got, want)
                       for a, b in zip(x.logprobs, y.logprobs))
            assert diff < 1e-5, diff
        else:
            assert [o.logprobs for o in got] == [o.logprobs for o in want], spec
        assert 0 < counts["accepted"] < counts["proposed"], counts
