"""Attention over the paged KV cache with torch's scaled_dot_product_attention (CPU and CUDA).

The batch is flat: the first `num_decode` tokens are one-token decodes, the rest are prefill
chunks laid end to end. Decodes are grouped by context length and each group runs as one padded
SDPA call (so a 30-token context is not padded to 500); each prefill chunk runs as its own call
(padding a 512-token chunk beside 63 decodes would waste 63x the work). A chunk with no
earlier context attends to its own fresh K/V; one with context (a later chunk, or a prefix-cache
hit) gathers its pages from the cache. Everything that does not depend on the layer is built
once per step in `AttentionMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One sequence's chunk: tokens [start, start+q_len) of the batch, ending at context kv_len."""

    start: int
    q_len: int
    kv_len: int
    kv_slots: torch.Tensor | None  # cache slots of all kv_len tokens; None when kv_len == q_len
    mask: torch.Tensor | None  # [q_len, kv_len] bool, True = may attend


@dataclass
class DecodeGroup:
    """Decodes of similar context length: batch rows `rows`, their padded cache slots [g, L] and
    a mask [g, 1, 1, L] (None when every context in the group has length L)."""

    rows: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    num_decode: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]


# A decode joins the current group while its context is at least this fraction of the group's
# longest: padding waste stays under 1 - GROUP_RATIO, at a few extra SDPA calls per layer.
GROUP_RATIO = 0.6


def _decode_groups(decodes: list[tuple[list[int], int]], page_size: int,
                   device: torch.device) -> tuple[list[DecodeGroup], torch.Tensor]:
    """The groups, and each decode's new-token slot in batch order."""
    lens = torch.tensor([n for _, n in decodes])
    order = sorted(range(len(decodes)), key=lambda i: -decodes[i][1])
    groups, new_slots = [], torch.empty(len(decodes), dtype=torch.long)
    start = 0
    while start < len(order):
        width = decodes[order[start]][1]
        end = start
        while end < len(order) and decodes[order[end]][1] >= GROUP_RATIO * width:
            end += 1
        rows = torch.tensor(order[start:end])
        table = torch.zeros(len(rows), -(-width // page_size), dtype=torch.long)
        for j, i in enumerate(order[start:end]):
            table[j, : len(decodes[i][0])] = torch.tensor(decodes[i][0])
        g_lens = lens[rows]
        pos = torch.arange(width)
        # Padding reads the sequence's last real slot, never an unwritten one: the mask hides it,
        # but 0 * NaN from uninitialised cache memory would still poison the output.
        real = torch.minimum(pos[None, :], g_lens[:, None] - 1)
        slots = table.gather(1, real // page_size) * page_size + real % page_size
        new_slots[rows] = slots.gather(1, (g_lens - 1)[:, None]).squeeze(1)
        mask = None if bool((g_lens == width).all()) else (pos[None, :] < g_lens[:, None]).view(len(rows), 1, 1, width)
        groups.append(DecodeGroup(rows.to(device), slots.to(device), None if mask is None else mask.to(device)))
        start = end
    return groups, new_slots


def _slots(pages: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    pos = torch.arange(length)
    return pages[pos // page_size] * page_size + pos % page_size


def build_metadata(
    page_size: int,
    decodes: list[tuple[list[int], int]],
    prefills: list[tuple[list[int], int, int]],
    device: torch.device,
) -> AttentionMetadata:
    """decodes: (pages, context length including the new token), in batch order;
    prefills: (pages, chunk length, context length through the chunk's last token)."""
    slot_parts: list[torch.Tensor] = []
    groups: list[DecodeGroup] = []
    if decodes:
        groups, new_slots = _decode_groups(decodes, page_size, device)
        slot_parts.append(new_slots)
    chunks, start = [], len(decodes)
    for pages, q_len, kv_len in prefills:
        ctx = _slots(torch.tensor(pages, dtype=torch.long), kv_len, page_size)
        slot_parts.append(ctx[kv_len - q_len :])
        if kv_len == q_len:
            chunks.append(PrefillChunk(start, q_len, kv_len, None, None))
        else:
            pos = torch.arange(kv_len - q_len, kv_len)
            mask = torch.arange(kv_len)[None, :] <= pos[:, None]
            chunks.append(PrefillChunk(start, q_len, kv_len, ctx.to(device), mask.to(device)))
        start += q_len
    slots = torch.cat(slot_parts).to(device)
    return AttentionMetadata(slots, len(decodes), groups, chunks)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache rows at `slots` (any shape). index_select on a flat index is ~5x faster on CPU than
    advanced indexing with a 2-D index."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


class TorchAttention:
    """Stateless backend; `kv_of_q` is set when query groups are uneven (see HeadShard)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 kv_of_q: torch.Tensor | None = None):
        self.h, self.hkv, self.d, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.kv_of_q = kv_of_q

    def _expand(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """K/V laid [..., heads, seq, dim]; returns them with a flag for SDPA's grouped mode."""
        if self.kv_of_q is not None:
            return k.index_select(-3, self.kv_of_q), v.index_select(-3, self.kv_of_q), False
        return k, v, self.hkv != self.h

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, d]; k, v: [T, Hkv, d]; caches: [slots, Hkv, d]. Returns [T, H, d]."""
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for g in meta.decode_groups:
            kk = _gather(k_cache, g.slots).transpose(1, 2)  # [g, Hkv, L, d]
            vv = _gather(v_cache, g.slots).transpose(1, 2)
            kk, vv, gqa = self._expand(kk, vv)
            o = F.scaled_dot_product_attention(
                q.index_select(0, g.rows).unsqueeze(2), kk, vv, attn_mask=g.mask, scale=self.scale, enable_gqa=gqa
            )
            out.index_copy_(0, g.rows, o.squeeze(2))
        for c in meta.prefills:
            qq = q[c.start : c.start + c.q_len].transpose(0, 1)
            if c.kv_slots is None:
                kk = k[c.start : c.start + c.q_len].transpose(0, 1)
                vv = v[c.start : c.start + c.q_len].transpose(0, 1)
            else:
                kk, vv = _gather(k_cache, c.kv_slots).transpose(0, 1), _gather(v_cache, c.kv_slots).transpose(0, 1)
            kk, vv, gqa = self._expand(kk, vv)
            o = F.scaled_dot_product_attention(
                qq, kk, vv, attn_mask=c.mask, is_causal=c.mask is None, scale=self.scale, enable_gqa=gqa
            )
            out[c.start : c.start + c.q_len] = o.transpose(0, 1)
        return out
