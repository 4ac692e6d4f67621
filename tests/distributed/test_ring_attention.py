"""Ring attention (context parallelism's core) over 2 and 3 gloo ranks equals one process's
causal attention, on lengths below 2N, not divisible by 2N and a few hundred; with a later chunk's
queries over earlier keys spread over the ranks another way; decode queries over KV spread by page
and merged with one all-gather; ring bytes equal the arithmetic; the zigzag split balances causal
work where a contiguous split does not."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from ranks import run_ranks

from shardserve.attention.ring import (
    attend,
    causal_pairs,
    merge,
    merge_across,
    ring_attention,
    zigzag_index,
    zigzag_ranges,
)

H, HKV, D = 4, 2, 8
SCALE = 1 / math.sqrt(D)
LENGTHS = (3, 37, 300)


def inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, H, D, generator=g), torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int = 0) -> torch.Tensor:
    """Queries at positions first.. over keys 0.., causal: one process, SDPA."""
    mask = torch.arange(k.shape[0])[None, :] <= torch.arange(first, first + q.shape[0])[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=SCALE, enable_gqa=True)
    return out[0].transpose(0, 1)


def ring_on_rank(comm) -> list:
    results = []
    for n in LENGTHS:
        q, k, v = inputs(n, n)
        idx = zigzag_index(n, comm.size, comm.rank)
        out, _ = ring_attention(comm, q[idx], k[idx], v[idx], idx, idx, SCALE)
        results.append((idx, out, comm.traffic_report().get("ring", {"calls": 0, "MB": 0.0})))
    # A later chunk (positions 40..99, zigzag over the ranks) over keys 0..99 whose first 40 live
    # round-robin by page of 8 (as older context in the ranks' pools would).
    q, k, v = inputs(100, 7)
    chunk = 40 + zigzag_index(60, comm.size, comm.rank)
    older = torch.tensor([p for p in range(40) if (p // 8) % comm.size == comm.rank], dtype=torch.long)
    keys = torch.cat([older, chunk])
    out, _ = ring_attention(comm, q[chunk], k[keys], v[keys], chunk, keys, SCALE)
    results.append((chunk, out, None))
    # Decode: 3 new queries at positions 100..102 over 103 keys spread round-robin by page of 8
    # (positions 96..102 on one rank only); each rank attends to its own part, one merge.
    q, k, v = inputs(103, 9)
    mine = torch.tensor([p for p in range(103) if (p // 8) % comm.size == comm.rank], dtype=torch.long)
    new = torch.arange(100, 103)
    part, lse = attend(q[new], k[mine], v[mine], new, mine, SCALE)
    results.append((new, merge_across(comm, part, lse), None))
    return results


@pytest.mark.parametrize("ranks", [2, 3])  # 3: blocks of uneven length
def test_ring_attention_equals_one_process(ranks):
    per_rank = run_ranks(ring_on_rank, ranks)
    block_bytes = 2 * HKV * D * 4 + 8  # K and V rows plus a position, per token
    for case, n in enumerate(LENGTHS):
        q, k, v = inputs(n, n)
        want = reference(q, k, v)
        lengths = [len(zigzag_index(n, ranks, r)) for r in range(ranks)]
        assert sorted(torch.cat([per_rank[r][case][0] for r in range(ranks)]).tolist()) == list(range(n))
        sent_before = [per_rank[r][case - 1][2]["MB"] if case else 0.0 for r in range(ranks)]
        for r in range(ranks):
            idx, out, traffic = per_rank[r][case]
            torch.testing.assert_close(out, want[idx], rtol=1e-5, atol=1e-5)
            # Over N-1 hops a rank passes on its own block, then each block it received.
            sent = sum(lengths[(r - hop) % ranks] for hop in range(ranks - 1)) * block_bytes
            assert round((traffic["MB"] - sent_before[r]) * 1e6) == sent
    q, k, v = inputs(100, 7)
    want = reference(q[40:], k, v, first=40)
    for r in range(ranks):
        chunk, out, _ = per_rank[r][-2]
        torch.testing.assert_close(out, want[chunk - 40], rtol=1e-5, atol=1e-5)
    q, k, v = inputs(103, 9)
    want = reference(q[100:], k, v, first=100)
    for r in range(ranks):  # every rank holds the merged decode output
        torch.testing.assert_close(per_rank[r][-1][1], want, rtol=1e-5, atol=1e-5)


def test_merge_of_a_block_no_row_sees_is_the_identity():
    q, k, v = inputs(6, 1)
    pos = torch.arange(6)
    out, lse = attend(q, k, v, pos, pos, SCALE)
    later, later_lse = attend(q, k, v, pos, pos + 100, SCALE)  # every key after every query
    assert torch.isinf(later_lse).all() and not later.any()
    merged, merged_lse = merge(out, lse, later, later_lse)
    torch.testing.assert_close(merged, out)
    torch.testing.assert_close(merged_lse, lse)
    nothing, nothing_lse = merge(later, later_lse, later, later_lse)  # no key at all: zeros, not NaN
    assert not nothing.isnan().any() and not nothing.any() and torch.isinf(nothing_lse).all()


def test_zigzag_balances_causal_work():
    n, ranks = 1024, 4
    assert [zigzag_ranges(10, 2, r) for r in range(2)] == [[(0, 3), (8, 10)], [(3, 6), (6, 8)]]
    pos = torch.arange(n)
    zig = [causal_pairs(zigzag_index(n, ranks, r), pos) for r in range(ranks)]
    flat = [causal_pairs(pos[r * n // ranks:(r + 1) * n // ranks], pos) for r in range(ranks)]
    assert sum(zig) == sum(flat) == n * (n + 1) // 2
    assert max(zig) * ranks / sum(zig) < 1.01 and max(flat) * ranks / sum(flat) > 1.7


LATENT = 24  # latent attention's cached vector: keys and values at once


def latent_ring_on_rank(comm) -> tuple:
    g = torch.Generator().manual_seed(3)
    q, kv = torch.randn(37, H, LATENT, generator=g), torch.randn(37, 1, LATENT, generator=g)
    idx = zigzag_index(37, comm.size, comm.rank)
    keys = kv[idx]
    out, _ = ring_attention(comm, q[idx], keys, keys, idx, idx, SCALE)  # the same tensor as values
    return idx, out, comm.traffic_report()["ring"]["MB"]


def test_latent_ring_ships_each_block_once():
    """Values that are the keys travel once: a hop's bytes are the latent rows and positions."""
    per_rank = run_ranks(latent_ring_on_rank, 2)
    g = torch.Generator().manual_seed(3)
    q, kv = torch.randn(37, H, LATENT, generator=g), torch.randn(37, 1, LATENT, generator=g)
    want = reference(q, kv, kv)
    for idx, out, mb in per_rank:
        torch.testing.assert_close(out, want[idx], rtol=1e-5, atol=1e-5)
        assert round(mb * 1e6) == len(idx) * (LATENT * 4 + 8)  # its own block, sent on the one hop
