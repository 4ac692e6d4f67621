"""Multi-head latent attention (DeepSeek-V2/V3), with the up-projections absorbed.

Each token's K and V come from one `kv_lora_rank` latent c (kv_a_proj_with_mqa, then a norm)
through per-head up-projections W_uk and W_uv (kv_b_proj), plus a `qk_rope_head_dim` rotary key
shared by every head. The cache holds only [c | rotary key] per token (one "KV head"), and K and
V are never decompressed: for head h,

    q_h . k_h,s = (W_uk,h^T q_nope,h) . c_s + q_rope,h . k_rope,s
    sum_s p_s v_h,s = W_uv,h (sum_s p_s c_s)

so attention is multi-query attention over [c | k_rope] with the query [W_uk^T q_nope | q_rope],
the values being the cached vectors themselves (their rotary tail is dropped from the output),
then W_uv per head. Every attention path (SDPA, the CPU paged kernel, ring attention) takes it
as it is, and decodes always run so.

A prefill chunk run by SDPA (not the batch-invariant paged path, which must be a decode's
arithmetic) is cheaper decompressed, as SGLang and vLLM prefill: its context's latents (fresh, or
gathered from the cache) go through W_uk and W_uv once, then ordinary causal attention with
qk_nope + rope dims per head scores and v dims values, instead of kv_lora_rank + rope for both
(the README measures it).

Under tensor parallelism the query heads split as usual; every rank computes and caches the
whole latent (it is one head, replicated): that duplication is what data-parallel attention
removes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.attention.backend import Heads
from shardserve.attention.metadata import PrefillChunk
from shardserve.distributed.communicator import Communicator
from shardserve.layers.attention import ForwardContext
from shardserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, copy_into, make_param
from shardserve.layers.norm import RMSNorm
from shardserve.layers.rotary import apply_rotary
from shardserve.layers.sharding import head_shard
from shardserve.model_config import ModelConfig

LORA_NORM_EPS = 1e-6  # the q_a/kv_a norms' epsilon: DeepSeek's code leaves them at the default


class LatentUpProjection(nn.Module):
    """kv_b_proj ([heads * (nope + v), kv_lora_rank] in the checkpoint): this rank's heads' rows,
    kept after loading only as `w_uk` [h, nope, lora] and `w_uv` [h, v, lora]."""

    def __init__(self, lora: int, heads: int, nope: int, v: int, rows: tuple[int, int], dtype, device):
        super().__init__()
        self.heads, self.nope, self.v, self.rows = heads, nope, v, rows
        self.weight = make_param((rows[1] - rows[0], lora), dtype, device, self._load, [None])
        self.w_uk = self.w_uv = None

    def _load(self, param, src, shard_id=None) -> None:
        copy_into(param.data, src.read(0, *self.rows), src.name)

    def process_after_loading(self) -> None:
        w = self.weight.data.view(self.heads, self.nope + self.v, -1)
        self.w_uk, self.w_uv = w[:, : self.nope].contiguous(), w[:, self.nope :].contiguous()
        self.weight = None


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary pairs (x0, x1), (x2, x3) .. to the rotate-half layout [x0, x2, .., x1, x3, ..]. Both
    q and k are permuted alike, so their dot products (all attention sees) are unchanged."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, comm: Communicator, dtype, device):
        super().__init__()
        m = cfg.mla
        self.layer_idx = layer_idx
        shard = head_shard(cfg.num_heads, 1, comm.size, comm.rank)
        self.h, self.nope, self.rope, self.lora, self.vd = (shard.num_q, m.qk_nope_head_dim, m.qk_rope_head_dim,
                                                           m.kv_lora_rank, m.v_head_dim)
        self.interleaved = m.rope_interleave
        qk = self.nope + self.rope

        def heads(width: int) -> tuple[int, int]:
            return shard.q_start * width, shard.q_end * width

        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if m.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(cfg.hidden_size, m.q_lora_rank, cfg.attention_bias, dtype, device)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS, dtype, device)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, [(None, heads(qk))], False, dtype, device)
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, [(None, heads(qk))], False, dtype, device)
        self.kv_a_proj_with_mqa = ReplicatedLinear(cfg.hidden_size, self.lora + self.rope, cfg.attention_bias,
                                                   dtype, device)
        self.kv_a_layernorm = RMSNorm(self.lora, LORA_NORM_EPS, dtype, device)
        self.kv_b_proj = LatentUpProjection(self.lora, self.h, self.nope, self.vd, heads(self.nope + self.vd),
                                            dtype, device)
        self.o_proj = RowParallelLinear(cfg.num_heads * self.vd, cfg.hidden_size, cfg.attention_bias, comm, dtype,
                                        device, in_range=heads(self.vd))
        self.scale = scale = qk**-0.5 * (cfg.rope_scaling.softmax_scale_factor if cfg.rope_scaling is not None
                                         else 1.0)
        width = self.lora + self.rope
        self.heads = Heads(self.h, 1, width, scale, shard.kv_of_q, device)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q_nope, q_rope = self._query(x).view(t, self.h, self.nope + self.rope).split([self.nope, self.rope], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.lora, self.rope], -1)
        latent = self.kv_a_layernorm(latent.contiguous())
        k_rope = k_rope.reshape(t, 1, self.rope)
        if self.interleaved:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = apply_rotary(q_rope.contiguous(), k_rope.contiguous(), *ctx.rope)
        cache, _ = ctx.kv_caches[self.layer_idx]
        meta, backend = ctx.attn, ctx.backend
        decompress = backend.sdpa_prefills(meta)
        # The rows attended absorbed: all of them, or only the decodes when prefill decompresses (the
        # W_uk and W_uv products of prefill rows would be thrown away).
        n = meta.num_decode if decompress else t
        q_latent = torch.bmm(q_nope[:n].transpose(0, 1), self.kv_b_proj.w_uk).transpose(0, 1)  # [n, h, lora]
        query = torch.cat((q_latent, q_rope[:n]), dim=-1)
        key = torch.cat((latent.unsqueeze(1), k_rope), dim=-1)  # [t, 1, lora + rope]: what is cached
        if decompress:  # the backend writes every row's cache and runs the decodes only
            meta = dataclasses.replace(meta, prefills=[])
        # Values are the cached vectors themselves: the same tensor is passed as both.
        o_latent = backend.forward(self.heads, query, key, key, cache, cache, meta)[..., : self.lora]
        o = q_nope.new_empty(t, self.h, self.vd)
        o[:n] = torch.bmm(o_latent.transpose(0, 1), self.kv_b_proj.w_uv.transpose(1, 2)).transpose(0, 1)
        if decompress:
            for c in ctx.attn.prefills:
                rows = slice(c.start, c.start + c.q_len)
                o[rows] = self._prefill(q_nope[rows], q_rope[rows], key[rows, 0], cache, c)
        return self.o_proj(o.reshape(t, self.h * self.vd))

    def _prefill(self, q_nope: torch.Tensor, q_rope: torch.Tensor, fresh: torch.Tensor, cache: torch.Tensor,
                 c: PrefillChunk) -> torch.Tensor:
        """One chunk's attention with K and V decompressed from its context's latents: [q, h, v]."""
        ctx = fresh if c.kv_slots is None else cache.index_select(0, c.kv_slots.reshape(-1))[:, 0]  # [s, lora + rope]
        latent, k_rope = ctx.split([self.lora, self.rope], -1)
        k_nope = torch.einsum("sc,hnc->hsn", latent, self.kv_b_proj.w_uk)
        v = torch.einsum("sc,hvc->hsv", latent, self.kv_b_proj.w_uv)
        k = torch.cat((k_nope, k_rope.unsqueeze(0).expand(self.h, -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(0, 1)  # [h, q, nope + rope]
        # Values padded to the keys' width: SDPA's CPU flash kernel wants them equal (it falls to
        # the math path, scores materialised, otherwise: 6x slower at 2,048 tokens). And 4-D
        # inputs: 3-D ones take the math path too.
        v = F.pad(v, (0, k.shape[-1] - self.vd)) if k.shape[-1] > self.vd else v
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=c.mask, is_causal=c.mask is None,
                                           scale=self.scale)
        return o[0, ..., : self.vd].transpose(0, 1)
