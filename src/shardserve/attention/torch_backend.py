"""Attention over the paged KV cache with torch's scaled_dot_product_attention (CPU and CUDA).

Each prefill chunk runs as its own SDPA call (padding a 512-token chunk beside 63 decodes would
waste 63x the work); a chunk with earlier context gathers its pages from the cache. Decodes run
either through the CPU C kernel, which reads pages in place (`meta.paged`), or as one padded
SDPA call per group of similar context lengths over gathered pages (`meta.decode_groups`).
What does not depend on the layer is built once per step (attention/metadata.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardserve.attention import cpu_kernel
from shardserve.attention.metadata import AttentionMetadata


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache rows at `slots` (any shape). index_select on a flat index is much faster on CPU than
    advanced indexing with a 2-D index."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


class TorchAttention:
    """Stateless backend for one layer's local heads; `kv_of_q[h]` is the KV head query head h
    reads (uneven groups happen when tensor parallelism replicates a KV head, see HeadShard)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 kv_of_q: tuple[int, ...], device: torch.device | None = None):
        self.h, self.hkv, self.d, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.kv_index = torch.tensor(kv_of_q, dtype=torch.long, device=device)
        uniform = num_heads % num_kv_heads == 0 and kv_of_q == tuple(
            i // (num_heads // num_kv_heads) for i in range(num_heads))
        self.kv_of_q = None if uniform else self.kv_index  # SDPA needs K/V expanded only then

    def _expand(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """K/V laid [..., heads, seq, dim]; returns them with a flag for SDPA's grouped mode."""
        if self.kv_of_q is not None:
            return k.index_select(-3, self.kv_of_q), v.index_select(-3, self.kv_of_q), False
        return k, v, self.hkv != self.h

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, d]; k, v: [T, Hkv, d]; caches: [slots, Hkv, d]. Returns [T, H, d]. One cache
        passed as both (latent attention: the values are the keys) is written and read once. With
        no prefill chunks in `meta`, q may hold only the decode rows (latent attention prefills
        apart) and the result has as many."""
        k_cache.index_copy_(0, meta.slot_mapping, k)
        if v_cache is not k_cache:
            v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.paged is not None:
            p = meta.paged
            cpu_kernel.paged_decode(q[: meta.num_decode], k_cache, v_cache, p.block_tables, p.context_lens,
                                    self.kv_index, meta.page_size, self.scale, out=out[: meta.num_decode])
        for g in meta.decode_groups:
            kk = _gather(k_cache, g.slots).transpose(1, 2)  # [g, Hkv, L, d]
            vv = kk if v_cache is k_cache else _gather(v_cache, g.slots).transpose(1, 2)
            kk, vv, gqa = self._expand(kk, vv)
            o = F.scaled_dot_product_attention(
                q.index_select(0, g.rows).unsqueeze(2), kk, vv, attn_mask=g.mask, scale=self.scale, enable_gqa=gqa
            )
            out.index_copy_(0, g.rows, o.squeeze(2))
        if meta.paged_prefill is not None:  # prefill tokens as decodes (see attention/metadata.py)
            p, n = meta.paged_prefill, meta.num_decode
            cpu_kernel.paged_decode(q[n:], k_cache, v_cache, p.block_tables, p.context_lens, self.kv_index,
                                    meta.page_size, self.scale, out=out[n:])
        for c in meta.prefills if meta.paged_prefill is None else ():
            qq = q[c.start : c.start + c.q_len].transpose(0, 1)
            if c.kv_slots is None:
                kk = k[c.start : c.start + c.q_len].transpose(0, 1)
                vv = v[c.start : c.start + c.q_len].transpose(0, 1)
            else:
                kk = _gather(k_cache, c.kv_slots).transpose(0, 1)
                vv = kk if v_cache is k_cache else _gather(v_cache, c.kv_slots).transpose(0, 1)
            kk, vv, gqa = self._expand(kk, vv)
            # 4-D inputs: on the CPU, 3-D ones take SDPA's slower math path, 4-D its flash kernel.
            o = F.scaled_dot_product_attention(
                qq[None], kk[None], vv[None], attn_mask=c.mask, is_causal=c.mask is None, scale=self.scale,
                enable_gqa=gqa,
            )
            out[c.start : c.start + c.q_len] = o[0].transpose(0, 1)
        return out
