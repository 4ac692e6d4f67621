"""Context parallelism end to end: a request's KV spread page by page over N ranks' pools gives
transformers' tokens and log-probabilities (within 1e-4) on prompts below 2N tokens, not
divisible by 2N and of several hundred, with chunked prefill, prefix-cache hits, seeded sampling
and prompt logprobs equal to one rank's; both decode attentions (the C kernel and the padded
gather) return what merging needs; a prompt too long for one rank's pool runs at CP 2, and
preempted requests recompute the same tokens; under pipeline stages and replicas too."""

from __future__ import annotations

import pytest
import torch
from test_pipeline import NEW, SCORED, SEEDED, TOP, assert_logprobs_close, hf_reference

from shardserve import LLM, SamplingParams

LENGTHS = (1, 3, 37, 300)
# A 64-token step budget cuts the 300-token prompt into five chunks.
ENGINE = dict(num_pages=64, page_size=8, max_num_batched_tokens=64, show_progress=False)
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, logprobs=TOP)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Per architecture: checkpoint, prompts, transformers' tokens and logprobs, and one rank's
    seeded sample and prompt logprobs."""
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            path, model = tiny_model(arch)
            g = torch.Generator().manual_seed(3)
            batch = [torch.randint(model.config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
            hf = [hf_reference(model, p) for p in batch]
            with LLM(path, **ENGINE) as one:
                seeded = one.generate(batch[2:3], SEEDED, use_tqdm=False)[0].token_ids
                scored = one.generate(batch[2:3], SCORED, use_tqdm=False)[0].prompt_logprobs
            cache[arch] = (path, batch, hf, seeded, scored)
        return cache[arch]

    return get


# (arch, cp, tp, attention backend): CP 2, 3 and 4; CP 2 x TP 2 on both architectures, one of them
# with the gather-based decode attention instead of the C kernel; CP 2 over the Triton kernels.
MATRIX = [("llama", 2, 1, "auto"), ("llama", 3, 1, "auto"), ("qwen3", 4, 1, "auto"), ("llama", 2, 2, "auto"),
          ("qwen3", 2, 2, "torch"), ("llama", 2, 1, "triton")]


@pytest.mark.slow
@pytest.mark.parametrize("arch,cp,tp,backend", MATRIX, ids=[f"{a}-cp{c}-tp{t}-{b}" for a, c, t, b in MATRIX])
def test_cp_matches_transformers(reference, arch, cp, tp, backend):
    path, batch, hf, seeded, scored = reference(arch)
    with LLM(path, cp_size=cp, tp_size=tp, attention_backend=backend, **ENGINE) as llm:
        outs = llm.generate(batch, GREEDY, use_tqdm=False)
        again = llm.generate(batch, GREEDY, use_tqdm=False)  # full pages now come from the cache
        sampled = llm.generate(batch[2:3], SEEDED, use_tqdm=False)[0].token_ids
        prompt_lps = llm.generate(batch[2:3], SCORED, use_tqdm=False)[0].prompt_logprobs
        report = llm.rank_reports()
    for out, (tokens, lps) in zip(outs, hf):
        assert out.token_ids == tokens
        assert_logprobs_close(out.logprobs, lps)
    assert [o.token_ids for o in again] == [t for t, _ in hf]
    assert [o.num_cached_tokens for o in again] == [0, 0, 32, 296]  # every full page but the last token's
    assert sampled == seeded
    assert [e["token_id"] for e in prompt_lps] == [e["token_id"] for e in scored]
    for mine, ref in zip(prompt_lps[1:], scored[1:]):
        assert abs(mine["logprob"] - ref["logprob"]) < 1e-4
    # Every context rank sent ring blocks; none sent any over a group it is not in.
    ring = [r["groups"]["context"]["ring"]["MB"] for r in report]
    assert len(ring) == cp * tp and min(ring) > 0


def test_prompt_too_long_for_one_pool_runs_at_cp2_and_preemption(tiny_model):
    """8 pages of 8 tokens per rank: 100 + 12 tokens need 14 pages, refused by one rank, 7 per
    pool at CP 2."""
    path, model = tiny_model("llama")
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(301, (100,), generator=g).tolist()
    small = dict(ENGINE, num_pages=8)
    with LLM(path, **small) as one, pytest.raises(ValueError, match="needs 14 KV pages but the pool holds 8"):
        one.generate([prompt], GREEDY, use_tqdm=False)
    # Then five requests of 3 pages each that grow to 4, in 16 pages: some are preempted and recomputed.
    crowd = [torch.randint(301, (17 + i,), generator=g).tolist() for i in range(5)]
    with LLM(path, cp_size=2, **small) as llm:
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        crowded = llm.generate(crowd, GREEDY, use_tqdm=False)
        status = llm.stats()
    assert status.pages_total == 16 and status.preemptions > 0 and status.pages_used == 0
    tokens, lps = hf_reference(model, prompt)
    assert out.token_ids == tokens
    assert_logprobs_close(out.logprobs, lps)
    assert [o.token_ids for o in crowded] == [hf_reference(model, p)[0] for p in crowd]


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [dict(pp_size=2), dict(dp_size=2)], ids=["cp2-pp2", "cp2-dp2"])
def test_cp_under_pipeline_stages_and_replicas(reference, sizes):
    """Each pipeline stage's context ranks pass their own rows on; each replica has its own context
    group and pools."""
    path, batch, hf, _, _ = reference("llama")
    with LLM(path, cp_size=2, **sizes, **ENGINE) as llm:
        outs = llm.generate(batch, GREEDY, use_tqdm=False)
    for out, (tokens, lps) in zip(outs, hf):
        assert out.token_ids == tokens
        assert_logprobs_close(out.logprobs, lps)
