"""Expert parallelism (--ep-size): tokens dispatched to the ranks owning their experts and back.

The dispatch on 3 gloo ranks against a one-process reference with exact byte counts, and whole
MoE models at EP 2, 3 (6 experts) and 4 equal to transformers' greedy tokens and log-probabilities.
"""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks

from shardserve import LLM, SamplingParams
from shardserve.layers.expert_dispatch import ExpertDispatch

EXPERTS, TOP_K, HIDDEN = 7, 3, 5  # 7 experts on 3 ranks: 3 + 2 + 2


def routing(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, HIDDEN, generator=g)
    experts = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(n)]) if n else \
        torch.zeros(0, TOP_K, dtype=torch.long)
    weights = torch.rand(n, TOP_K, generator=g)
    return x, weights, experts


def expert_fn(e: int, x: torch.Tensor) -> torch.Tensor:
    return x * (e + 1) + e  # distinct per expert, so a token sent to the wrong one shows


def dispatch_on_rank(comm):
    tokens = [4, 0, 6][comm.rank]  # rank 1 has no tokens and still joins both all-to-alls
    x, weights, experts = routing(comm.rank, tokens)
    d = ExpertDispatch(comm, EXPERTS)
    lo, hi = d.local_range()

    def compute(rows, local, w):
        out = torch.zeros_like(rows)
        for i in range(hi - lo):
            r, slot = (local == i).nonzero(as_tuple=True)
            out.index_add_(0, r, expert_fn(lo + i, rows[r]) * w[r, slot].unsqueeze(-1))
        return out

    return d(x, weights, experts, compute), (lo, hi), comm.traffic_report()


def test_dispatch_and_combine_match_one_process_with_exact_bytes():
    results = run_ranks(dispatch_on_rank, 3)
    owner = [0, 0, 0, 1, 1, 2, 2]
    assert [r[1] for r in results] == [(0, 3), (3, 5), (5, 7)]
    row_bytes = (HIDDEN + 2 * TOP_K) * 4
    received = [0, 0, 0]  # rows each rank gets from the others
    for rank, (out, _, traffic) in enumerate(results):
        x, weights, experts = routing(rank, [4, 0, 6][rank])
        ref = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(TOP_K):
                e = int(experts[t, j])
                ref[t] += weights[t, j] * expert_fn(e, x[t])
        torch.testing.assert_close(out, ref)
        # One row per token per distinct remote owner, however many of its experts live there.
        remote = [{owner[int(e)] for e in experts[t]} - {rank} for t in range(x.shape[0])]
        for dests in remote:
            for d in dests:
                received[d] += 1
        sent_rows = sum(len(d) for d in remote)
        results[rank] = (sent_rows, traffic)
    for rank, (sent_rows, traffic) in enumerate(results):
        combine_rows = received[rank]  # partials returned to their senders
        expected = sent_rows * row_bytes + combine_rows * HIDDEN * 4
        assert traffic["all_to_all"] == {"calls": 2, "MB": expected / 1e6}, rank


NEW = 10
ENGINE = dict(num_pages=64, page_size=8, max_num_batched_tokens=16, show_progress=False)
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, logprobs=3)


def hf_reference(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        logits = model(out[:, :-1]).logits[0, len(prompt) - 1 :]
    return out[0, len(prompt) :].tolist(), torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("ep", [2, 3, 4])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_ep_matches_transformers(tiny_model, arch, ep):
    path, model = tiny_model(arch)
    g = torch.Generator().manual_seed(4)
    batch = [torch.randint(model.config.vocab_size, (n,), generator=g).tolist() for n in (1, 9, 30)]
    with LLM(path, tp_size=ep, ep_size=ep, **ENGINE) as llm:
        outs = llm.generate(batch, GREEDY, use_tqdm=False)
        reports = llm.rank_reports()
    for out, prompt in zip(outs, batch):
        tokens, lps = hf_reference(model, prompt)
        assert out.token_ids == tokens
        for entry, row in zip(out.logprobs, lps, strict=True):
            assert abs(entry["logprob"] - float(row[entry["token_id"]])) < 1e-4
    moe_layers = sum(type(m).__name__.endswith("SparseMoeBlock") for m in model.modules())
    for r in reports:  # tokens went to their experts over the expert group, two calls per MoE layer
        calls = r["groups"]["expert"]["all_to_all"]["calls"]
        assert moe_layers and calls > 0 and calls % (2 * moe_layers) == 0


def test_ep_refusals(tiny_model):
    path, _ = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="--ep-size 2 does not divide the 1 ranks"):
        LLM(path, ep_size=2)
    with pytest.raises(ValueError, match=r"--ep-size 2 must equal --tp-size \(4\)"):
        LLM(path, tp_size=4, ep_size=2)
    with pytest.raises(ValueError, match="--ep-size 2 needs a mixture-of-experts model"):
        LLM(tiny_model("llama")[0], tp_size=2, ep_size=2)
