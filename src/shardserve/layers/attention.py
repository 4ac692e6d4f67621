"""The attention block shared by every architecture: fused q/k/v, optional q/k norms, RoPE,
paged attention, o_proj. Which heads a rank owns comes from `head_shard`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardserve.attention.backend import AttentionBackend, Heads
from shardserve.attention.context import ContextMetadata
from shardserve.attention.metadata import AttentionMetadata
from shardserve.config import ModelConfig
from shardserve.distributed.communicator import Communicator
from shardserve.layers.linear import RowParallelLinear, qkv_linear
from shardserve.layers.norm import RMSNorm
from shardserve.layers.rotary import apply_rotary
from shardserve.layers.sharding import head_shard


@dataclass
class ForwardContext:
    """Per-step inputs every layer may read: the KV cache views, the attention metadata and the
    backend that reads it (the model runner's, chosen once)."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: ([slots, Hkv, d], same)
    attn: AttentionMetadata | ContextMetadata  # the latter under context parallelism
    backend: AttentionBackend
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of this step's positions
    # Where only some layers keep a sliding window (Gemma 3), the metadata those read (`attn`
    # being the full-attention layers'), and their rope tables where they differ; else None.
    attn_window: AttentionMetadata | None = None
    rope_window: tuple[torch.Tensor, torch.Tensor] | None = None
    # Called with each layer's index once it has run (a prefill instance ships that layer's KV).
    after_layer: Callable[[int], None] | None = None


class SelfAttention(nn.Module):
    """Llama-family attention. `qk_norm` adds Qwen3's per-head RMSNorm on q and k before RoPE (of
    class `norm`: Gemma's scales by 1 + w)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, comm: Communicator, dtype, device,
                 qk_norm: bool = False, norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        self.layer_idx = layer_idx
        self.windowed = cfg.windowed(layer_idx)  # reads ForwardContext.attn_window where there is one
        shard = head_shard(cfg.num_heads, cfg.num_kv_heads, comm.size, comm.rank)
        self.hq, self.hkv, self.d = shard.num_q, shard.num_kv, cfg.head_dim
        self.rotary_dim = cfg.rotary_dim  # what the C decode loop rotates (the tables are as wide)
        self.qkv_proj = qkv_linear(cfg.hidden_size, self.d, shard, cfg.attention_bias, dtype, device)
        o_range = (shard.q_start * self.d, shard.q_end * self.d)
        self.o_proj = RowParallelLinear(cfg.num_heads * self.d, cfg.hidden_size, False, comm, dtype, device,
                                        in_range=o_range)
        self.q_norm = norm(self.d, cfg.rms_norm_eps, dtype, device) if qk_norm else None
        self.k_norm = norm(self.d, cfg.rms_norm_eps, dtype, device) if qk_norm else None
        scale = (cfg.query_pre_attn_scalar or self.d) ** -0.5
        self.heads = Heads(self.hq, self.hkv, self.d, scale, shard.kv_of_q, device, cfg.attn_logit_softcap or 0.0)

    @property
    def takes_bf16_input(self) -> bool:
        """Whether forward takes x as bfloat16 rows already rounded (the q/k/v product's)."""
        return self.qkv_proj.takes_bf16_input

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q, k, v = q.view(t, self.hq, self.d), k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        own_window = self.windowed and ctx.attn_window is not None
        q, k = apply_rotary(q, k, *(ctx.rope_window if self.windowed and ctx.rope_window else ctx.rope))
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        o = ctx.backend.forward(self.heads, q, k, v, k_cache, v_cache, ctx.attn_window if own_window else ctx.attn)
        return self.o_proj(o.reshape(t, self.hq * self.d))
