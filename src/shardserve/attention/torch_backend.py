"""Attention over the paged KV cache with torch's scaled_dot_product_attention (any device).

Each prefill chunk runs as its own SDPA call (padding a 512-token chunk beside 63 decodes would
waste 63x the work); a chunk with earlier context gathers its pages from the cache. Decodes run
as one padded SDPA call per group of similar context lengths over gathered pages
(`meta.decode_groups`). The CPU backend (attention/cpu_backend.py) keeps the prefill half and
runs decodes through its C kernel instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardserve.attention.backend import AttentionBackend, Heads, begin
from shardserve.attention.metadata import AttentionMetadata, build_metadata


def gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """cache rows at `slots` (any shape), in `dtype` where given (a bfloat16 cache read by float32
    queries). index_select on a flat index is much faster on CPU than advanced indexing with a
    2-D index."""
    rows = cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])
    return rows if dtype is None else rows.to(dtype)


def as_cached(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x as the cache holds it (rounded where the cache is narrower: a bfloat16 cache under float32
    compute), in x's dtype."""
    return x if cache.dtype == x.dtype else x.to(cache.dtype).to(x.dtype)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: Heads, gqa: bool,
         mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """SDPA over [..., heads, length, dim] (k and v with fewer heads where `gqa`); where the heads
    cap their scores (Gemma 2), which SDPA has no place for, the same steps written out in float32:
    scores, the cap, the mask, the softmax, the values."""
    if not heads.softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=heads.scale,
                                              enable_gqa=gqa)
    if gqa:
        k, v = (t.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for t in (k, v))
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * heads.scale
    s = torch.tanh(s / heads.softcap) * heads.softcap
    if causal:  # SDPA's is_causal: a square chunk's own keys
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


class TorchBackend(AttentionBackend):
    name = "torch"

    def prepare(self, page_size, decodes, prefills, device, window=None, horizons=None) -> AttentionMetadata:
        return build_metadata(page_size, decodes, prefills, device, window=window, horizons=horizons)

    def forward(self, heads: Heads, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """With no prefill chunks in `meta`, q may hold only the decode rows (latent attention
        prefills apart) and the result has as many."""
        out = begin(q, k, v, k_cache, v_cache, meta)
        self._decodes(heads, q, k_cache, v_cache, meta, out)
        self._prefills(heads, q, k, v, k_cache, v_cache, meta, out)
        return out

    def sdpa_prefills(self, meta: AttentionMetadata) -> bool:
        return bool(meta.prefills)

    def _decodes(self, heads: Heads, q, k_cache, v_cache, meta: AttentionMetadata, out: torch.Tensor) -> None:
        for g in meta.decode_groups:
            kk = gather(k_cache, g.slots, q.dtype).transpose(1, 2)  # [g, Hkv, L, d]
            vv = kk if v_cache is k_cache else gather(v_cache, g.slots, q.dtype).transpose(1, 2)
            kk, vv, gqa = heads.expand(kk, vv)
            o = sdpa(q.index_select(0, g.rows).unsqueeze(2), kk, vv, heads, gqa, mask=g.mask)
            out.index_copy_(0, g.rows, o.squeeze(2))

    def _prefills(self, heads: Heads, q, k, v, k_cache, v_cache, meta: AttentionMetadata, out: torch.Tensor) -> None:
        for c in meta.prefills:
            qq = q[c.start : c.start + c.q_len].transpose(0, 1)
            if c.kv_slots is None:  # as cached: a chunk's keys read alike fresh or from the cache
                kk = as_cached(k[c.start : c.start + c.q_len], k_cache).transpose(0, 1)
                vv = as_cached(v[c.start : c.start + c.q_len], v_cache).transpose(0, 1)
            else:
                kk = gather(k_cache, c.kv_slots, q.dtype).transpose(0, 1)
                vv = kk if v_cache is k_cache else gather(v_cache, c.kv_slots, q.dtype).transpose(0, 1)
            kk, vv, gqa = heads.expand(kk, vv)
            # 4-D inputs: on the CPU, 3-D ones take SDPA's slower math path, 4-D its flash kernel.
            o = sdpa(qq[None], kk[None], vv[None], heads, gqa, mask=c.mask, causal=c.mask is None)
            out[c.start : c.start + c.q_len] = o[0].transpose(0, 1)

    def decode_lse(self, heads: Heads, q, k_cache, v_cache, block_tables, context_lens, max_len,
                   page_size) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, _ = q.shape
        if max_len == 0:
            return q.new_zeros(q.shape), torch.full((b, h), float("-inf"), dtype=torch.float32, device=q.device)
        pos = torch.arange(max_len, device=q.device)
        p = page_size
        slots = block_tables.gather(1, (pos // p).expand(b, -1)) * p + pos % p  # [B, L]
        pad = pos[None, :] >= context_lens[:, None]  # [B, L]
        kk = gather(k_cache, slots).index_select(2, heads.kv_index).float()  # [B, L, H, d]
        # Padding reads pages never written: zero its values, or 0 x NaN would poison the output.
        vv = gather(v_cache, slots).index_select(2, heads.kv_index).float().masked_fill(pad[..., None, None], 0.0)
        scores = torch.einsum("bhd,blhd->bhl", q.float(), kk) * heads.scale
        if heads.softcap:
            scores = torch.tanh(scores / heads.softcap) * heads.softcap
        scores = scores.masked_fill(pad[:, None], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        return torch.einsum("bhl,blhd->bhd", probs, vv).to(q.dtype), lse
