"""Context parallelism's attention: the zigzag split and ring attention merged by log-sum-exp.

A long prompt's tokens are split over the N ranks of the context group. Causal attention work is
triangular, so a contiguous split would give the last rank 2N-1 times the first rank's work; the
**zigzag** split cuts the sequence into 2N near-equal pieces and gives rank r pieces r and
2N-1-r, so every rank does about the same work (`zigzag_ranges`).

**Ring attention**: each rank holds the queries and the K/V of its own tokens. Over N hops every
rank's K/V block (with the positions of its tokens) travels once around the ring; at each hop a
rank attends its queries to the block it holds, causally by position, while the next block is
already on the wire (non-blocking send and receive posted before the compute). The partial
outputs are merged with their log-sum-exps (`merge`): a row that sees no key in a block has
log-sum-exp -inf and weight 0, so it changes nothing. Blocks may differ in length (lengths that do
not divide by 2N, or a rank's share of older context), so the lengths are exchanged once first.

Bytes each rank sends per call: at hop h it forwards the block it holds (its own, then its
predecessors'), so every block but its successor's: (N-1) x its own block when the blocks are
equal (K and V, or only K where the values are the keys as under latent attention, plus 8 bytes
of position per token), counted on the context communicator.

**Decode** (`merge_across`): a request's KV stays spread over the ranks' pools, so each rank
attends the new tokens' queries to its own part and one all-gather of the partial outputs and
log-sum-exps per layer merges them; every rank ends with the full result.
"""

from __future__ import annotations

import torch

from shardserve.distributed.communicator import Communicator


def zigzag_ranges(n: int, ranks: int, rank: int) -> list[tuple[int, int]]:
    """Rank `rank`'s token ranges [start, end) of a sequence of `n`: pieces rank and 2N-1-rank of
    2N pieces as even as possible (earlier pieces one longer when n does not divide)."""
    pieces = 2 * ranks
    bounds = [i * (n // pieces) + min(i, n % pieces) for i in range(pieces + 1)]
    mine = [(bounds[rank], bounds[rank + 1]), (bounds[pieces - 1 - rank], bounds[pieces - rank])]
    return [(a, b) for a, b in mine if b > a]


def zigzag_index(n: int, ranks: int, rank: int) -> torch.Tensor:
    """The positions of rank `rank`'s tokens, ascending."""
    parts = [torch.arange(a, b) for a, b in zigzag_ranges(n, ranks, rank)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def causal_pairs(q_pos: torch.Tensor, k_pos: torch.Tensor) -> int:
    """Unmasked (query, key) pairs: the attention work of queries at q_pos over keys at k_pos."""
    return int((k_pos[None, :] <= q_pos[:, None]).sum())


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
           scale: float, kv_of_q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention by position, with its log-sum-exp. q [T, H, d]; k, v [S, Hkv, d]; query
    head h reads KV head kv_of_q[h] (default: groups of H / Hkv); positions [T] and [S]. Returns
    out [T, H, d] and lse [T, H] in float32; a row with no visible key gets out 0 and lse -inf."""
    t, h = q.shape[:2]
    if t == 0 or k.shape[0] == 0:
        return q.new_zeros(q.shape, dtype=torch.float32), q.new_full((t, h), float("-inf"), dtype=torch.float32)
    if kv_of_q is None:
        kv_of_q = torch.arange(h, device=q.device) // (h // k.shape[1])
    if k.shape[1] != h:
        k, v = k.index_select(1, kv_of_q), v.index_select(1, kv_of_q)
    visible = k_pos[None, :] <= q_pos[:, None]  # [T, S]
    if q.device.type == "cpu":  # torch's CPU flash kernel returns the log-sum-exp, and is far faster than the math path
        out, lse = _flash_cpu(q, k, v, visible, scale)
    else:
        out, lse = _math(q, k, v, visible, scale)
    blind = ~visible.any(dim=1)  # rows that see no key here: weight 0 in any merge
    if bool(blind.any()):
        lse = lse.masked_fill(blind[:, None], float("-inf"))
        out = out.masked_fill(blind[:, None, None], 0.0)
    return out, lse


def _flash_cpu(q, k, v, visible, scale) -> tuple[torch.Tensor, torch.Tensor]:
    bias = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.0, False,
        attn_mask=bias, scale=scale)
    return out[0].transpose(0, 1).float(), lse[0].transpose(0, 1).float()


def _math(q, k, v, visible, scale) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, T]
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("hts,shd->thd", probs, v.float()), lse.transpose(0, 1).contiguous()


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint key sets as one: weights exp(lse_i - lse)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), 0.0, lse)  # both -inf: no key at all, weights 0
    wa = torch.exp(lse_a - safe).nan_to_num(0.0)[..., None]
    wb = torch.exp(lse_b - safe).nan_to_num(0.0)[..., None]
    return out_a * wa + out_b * wb, lse


def ring_attention(comm: Communicator, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                   k_pos: torch.Tensor, scale: float, kv_of_q: torch.Tensor | None = None,
                   lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of this rank's queries over every rank's K/V (see the module docstring).
    `lengths`: every rank's number of keys, when the caller knows them (else one all-gather).
    Returns (out [T, H, d] in q's dtype, lse [T, H] float32)."""
    n = comm.size
    if lengths is None:
        lengths = comm.all_gather(torch.tensor([k.shape[0]], dtype=torch.int64, device=k.device), dim=0).tolist()
    # [S, 2, Hkv, d]: one send per hop; values that are the keys (latent attention) travel once.
    kv = (k.unsqueeze(1) if v is k else torch.stack([k, v], dim=1)).contiguous()
    pos = k_pos.to(torch.int64).contiguous()
    out = lse = None
    for hop in range(n):
        pending = []
        if hop < n - 1:  # post the next block's transfer before computing on this one
            src = (comm.rank - hop - 1) % n
            nxt_kv = kv.new_empty((lengths[src], *kv.shape[1:]))
            nxt_pos = pos.new_empty(lengths[src])
            pending = comm.ring_exchange([kv, pos], [nxt_kv, nxt_pos])
        part = attend(q, kv[:, 0], kv[:, -1], q_pos, pos, scale, kv_of_q)
        out, lse = part if out is None else merge(out, lse, *part)
        if pending:
            comm.wait_all(pending, "ring attention")
            kv, pos = nxt_kv, nxt_pos
    return out.to(q.dtype), lse


def merge_across(comm: Communicator, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Merge every rank's partial attention of the same queries over its own keys: out [T, H, d]
    and lse [T, H] (float32, -inf where a rank holds no visible key). One all-gather."""
    if comm.size == 1:
        return out
    t, h, d = out.shape
    packed = torch.cat([out.float().reshape(t, h * d), lse], dim=1)  # one collective, not two
    parts = comm.all_gather(packed.unsqueeze(0), dim=0)
    merged, merged_lse = parts[0, :, : h * d].view(t, h, d), parts[0, :, h * d :]
    for r in range(1, comm.size):
        merged, merged_lse = merge(merged, merged_lse, parts[r, :, : h * d].view(t, h, d), parts[r, :, h * d :])
    return merged.to(out.dtype)
