"""Attention under context parallelism: a request's KV spread page by page over N ranks' pools.

Each context rank runs the step's decodes whole (every rank has every decode's query, its KV
goes to the one rank whose page holds its position) and its own tokens of each prefill chunk
(those in its own pages, see kvcache/spread.py). Per layer:

- the rank writes the new K/V of the rows it stores (`write_rows`) into its pool;
- **decodes**: the rank attends each query to the keys in its own pages (the CPU C kernel, or a
  padded gather, both returning the log-sum-exp; a rank holding none of a request's keys gives
  lse -inf), and `merge_across` combines the ranks' partials with one all-gather;
- **prefill chunks**: ring attention (attention/ring.py), each rank's block being every key of
  the request it holds through the chunk (older pages too, so a later chunk and a prefix-cache
  hit see their whole context wherever it lives), masked causally by position.

Which rows, slots and positions those are is the engine's business (engine/context_inputs.py);
what is built once per step is here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardserve.attention import cpu_kernel
from shardserve.attention.ring import merge_across, ring_attention
from shardserve.distributed.communicator import Communicator


@dataclass
class ContextChunk:
    """This rank's part of one prefill chunk: rows [start, start + q_len) at positions q_pos, and
    every key of the request this rank holds through the chunk (its cache slots and positions);
    `lengths`: every context rank's number of such keys."""

    start: int
    q_len: int
    q_pos: torch.Tensor
    kv_slots: torch.Tensor
    k_pos: torch.Tensor
    lengths: list[int]


@dataclass
class ContextMetadata:
    comm: Communicator  # the context group
    slot_mapping: torch.Tensor  # cache slots of the rows this rank stores
    write_rows: torch.Tensor | None  # which rows those are (None: every row)
    num_decode: int
    block_tables: torch.Tensor  # [decodes, pages] this rank's pages of each decode (unused entries 0)
    context_lens: torch.Tensor  # [decodes] keys this rank holds of each decode (0 allowed)
    chunks: list[ContextChunk]
    page_size: int
    kernel: bool  # decodes through the CPU C kernel


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


class ContextAttention:
    """One layer's local heads under context parallelism; `kv_index[h]` is query head h's KV head."""

    def __init__(self, head_dim: int, scale: float, kv_index: torch.Tensor):
        self.d, self.scale, self.kv_index = head_dim, scale, kv_index

    def forward(self, q, k, v, k_cache, v_cache, meta: ContextMetadata) -> torch.Tensor:
        """q: [T, H, d]; k, v: [T, Hkv, d]; caches: [slots, Hkv, d]. Returns [T, H, d]."""
        if meta.write_rows is not None:
            k, v = k.index_select(0, meta.write_rows), v.index_select(0, meta.write_rows)
        k_cache.index_copy_(0, meta.slot_mapping, k)
        if v_cache is not k_cache:  # latent attention passes one cache as both
            v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        b = meta.num_decode
        if b:
            part, lse = self._decode_part(q[:b], k_cache, v_cache, meta)
            out[:b] = merge_across(meta.comm, part, lse)
        for c in meta.chunks:
            keys = _gather(k_cache, c.kv_slots)
            values = keys if v_cache is k_cache else _gather(v_cache, c.kv_slots)  # `is`: ships once
            o, _ = ring_attention(meta.comm, q[c.start : c.start + c.q_len], keys, values, c.q_pos, c.k_pos,
                                  self.scale, self.kv_index, c.lengths)
            out[c.start : c.start + c.q_len] = o
        return out

    def _decode_part(self, q, k_cache, v_cache, meta: ContextMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Each decode query over the keys in this rank's pages: (out, lse)."""
        b, h, _ = q.shape
        lse = torch.empty(b, h, dtype=torch.float32, device=q.device)
        if meta.kernel:
            out = cpu_kernel.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.kv_index,
                                          meta.page_size, self.scale, lse=lse)
            return out, lse
        width = int(meta.context_lens.max())
        if width == 0:
            return q.new_zeros(q.shape), lse.fill_(float("-inf"))
        pos = torch.arange(width, device=q.device)
        p = meta.page_size
        slots = meta.block_tables.gather(1, (pos // p).expand(b, -1)) * p + pos % p  # [B, L]
        pad = pos[None, :] >= meta.context_lens[:, None]  # [B, L]
        kk = _gather(k_cache, slots).index_select(2, self.kv_index).float()  # [B, L, H, d]
        # Padding reads pages never written: zero its values, or 0 x NaN would poison the output.
        vv = _gather(v_cache, slots).index_select(2, self.kv_index).float().masked_fill(pad[..., None, None], 0.0)
        scores = torch.einsum("bhd,blhd->bhl", q.float(), kk) * self.scale
        scores = scores.masked_fill(pad[:, None], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        return torch.einsum("bhl,blhd->bhd", probs, vv).to(q.dtype), lse
