"""The batched draw (engine/batch_sampling.py) against the whole-row filters, one row at a time."""

from __future__ import annotations

import pytest
import torch

from shardserve.engine import batch_sampling
from shardserve.engine.batch_sampling import STAGES, inverse_cdf, sample_rows
from shardserve.engine.sampler import filter_logits
from shardserve.sampling_params import SamplingParams

VOCAB = 3000  # between the last two stages

PARAMS = {
    "temperature": dict(temperature=0.8),
    "min_p": dict(temperature=1.0, min_p=0.05),
    "top_k": dict(temperature=0.7, top_k=40),
    "top_p": dict(temperature=0.9, top_p=0.9),
    "all": dict(temperature=0.7, top_k=200, top_p=0.8, min_p=0.02),
    "top_k_past_the_stages": dict(temperature=1.0, top_k=STAGES[1] + 300),  # past 1024: decided by the sort
    "flat_top_p": dict(temperature=5.0, top_p=0.99),
}


def logits_rows(n: int, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, VOCAB, generator=g) * scale


def gens(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def reference(row: torch.Tensor, p: SamplingParams, seed: int) -> int:
    """The whole row's filters in float64, drawn at the same uniform number as the batch."""
    u = float(torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))
    probs = filter_logits(row, p).double().softmax(-1)
    cdf = probs.cumsum(-1)
    return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("scale", [1.0, 4.0, 10.0])
def test_batched_draws_equal_the_whole_row_filters(name: str, scale: float) -> None:
    p = SamplingParams(**PARAMS[name])
    rows = logits_rows(24, scale, seed=int(scale * 10))
    seeds = list(range(100, 124))
    got = sample_rows(rows, [p] * 24, gens(seeds))
    assert got == [reference(rows[i], p, seeds[i]) for i in range(24)]


def test_a_row_draws_alike_alone_and_in_any_batch() -> None:
    rows = logits_rows(7, 4.0, seed=3)
    rows[6] = torch.randn(VOCAB, generator=torch.Generator().manual_seed(9)) * 0.1  # flat: no stage decides it
    params = [SamplingParams(**PARAMS[n]) for n in ["temperature", "min_p", "top_k", "top_p", "all",
                                                    "top_k_past_the_stages", "flat_top_p"]]
    together = sample_rows(rows, params, gens(list(range(7))))
    for i in range(7):
        assert sample_rows(rows[i : i + 1], params[i : i + 1], gens([i])) == [together[i]]
    order = [6, 2, 0, 5, 1, 4, 3]
    shuffled = sample_rows(rows[order], [params[i] for i in order], gens(order))
    assert shuffled == [together[i] for i in order]


def test_each_stage_takes_only_the_rows_the_last_left_open(monkeypatch) -> None:
    """A peaked row is decided by its first 64 candidates; a flat one under top-p, and top-k past
    the stages, go on to the whole vocabulary sorted."""
    peaked, flat = logits_rows(1, 10.0, seed=5)[0], torch.zeros(VOCAB)
    seen = []
    real = batch_sampling._candidate_rows

    def recording(x, params, u, k, row_lse):
        seen.append((k, len(params)))
        return real(x, params, u, k, row_lse)

    monkeypatch.setattr(batch_sampling, "_candidate_rows", recording)
    top_p = SamplingParams(temperature=1.0, top_p=0.9)
    big_k = SamplingParams(**PARAMS["top_k_past_the_stages"])
    got = sample_rows(torch.stack([peaked, flat, peaked]), [top_p, top_p, big_k], gens([1, 2, 3]))
    assert seen == [(64, 3), (1024, 2), (VOCAB, 2)]  # VOCAB < the last stage: the sort comes next
    assert got == [reference(r, p, s) for r, p, s in zip([peaked, flat, peaked], [top_p, top_p, big_k], [1, 2, 3])]


def test_draws_follow_the_kept_distribution() -> None:
    """Many seeds on one row: each kept token's frequency within 5 sigma of its probability, and
    nothing outside the kept set drawn."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    row = probs.log()
    p = SamplingParams(temperature=1.0, top_p=0.75)  # keeps 0.4, 0.25 and 0.15 (the one crossing 0.75)
    n = 6000
    got = sample_rows(row.expand(n, -1).contiguous(), [p] * n, gens(list(range(n))))
    counts = torch.bincount(torch.tensor(got), minlength=6).double()
    kept = probs[:3].double() / probs[:3].sum()
    assert counts[3:].sum() == 0
    sigma = (n * kept * (1 - kept)).sqrt()
    assert ((counts[:3] - n * kept).abs() < 5 * sigma).all(), counts


def test_inverse_cdf_never_draws_a_zero_weight() -> None:
    w = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0, 0.0]] * 4)
    u = torch.tensor([0.0, 1 / 3 - 1e-9, 1 / 3 + 1e-9, 1 - 2**-53], dtype=torch.float64)
    assert inverse_cdf(w, u).tolist() == [1, 1, 3, 3]


@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf")])
def test_inverse_cdf_refuses_a_row_with_nothing_to_draw(bad: float) -> None:
    w = torch.tensor([[1.0, 2.0], [bad, 0.0 if bad == 0.0 else 1.0]])
    with pytest.raises(ValueError, match="no token of finite positive probability"):
        inverse_cdf(w, torch.tensor([0.5, 0.5], dtype=torch.float64))


def test_the_4096_stage_decides_a_nucleus_of_thousands() -> None:
    g = torch.Generator().manual_seed(11)
    row = torch.cat([torch.linspace(2.0, 0.0, 2000) + 1e-3 * torch.rand(2000, generator=g), torch.full((4000,), -30.0)])
    row = row[torch.randperm(6000, generator=g)]
    p = SamplingParams(temperature=1.0, top_p=0.9)
    got = sample_rows(row.expand(8, -1).contiguous(), [p] * 8, gens(list(range(8))))
    assert got == [reference(row, p, s) for s in range(8)]


def test_a_temperature_below_1e_5_is_greedy() -> None:
    """As vLLM: dividing by a smaller one overflows the logits to infinity."""
    from shardserve.core import Request
    from shardserve.engine.sampler import Sampler

    rows = logits_rows(3, 4.0, seed=2)
    reqs = [Request(str(i), [1, 2], SamplingParams(temperature=t), [0]) for i, t in enumerate((1e-30, 9e-6, 0.0))]
    tokens, _ = Sampler()(rows, reqs)
    assert tokens == rows.argmax(-1).tolist()
