"""RMSNorm, computed in float32 as Hugging Face does, so logits match at fp32 tolerance."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.layers import cpu_ops, gpu_ops
from shardserve.layers.linear import copy_into, make_param


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = make_param((size,), dtype, device, self._load, [None])

    def _load(self, param, src, shard_id=None) -> None:
        copy_into(param.data, src.read(), src.name)

    def forward(self, x: torch.Tensor, bf16: bool = False) -> torch.Tensor:
        """`bf16`: the consumer takes bfloat16 rows (its takes_bf16_input): the C kernel then hands
        them so, rounded as the consumer would round them; elsewhere the rows are as without it."""
        if (out := cpu_ops.rms_norm(x, self.weight, self.eps, bf16)) is not None:
            return out
        if (out := gpu_ops.rms_norm(x, self.weight, self.eps)) is not None:
            return out
        if x.dtype == torch.float32:  # one fused op, same arithmetic
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the normalized rows times (1 + w), in float32 whatever the dtype (as
    transformers computes it). It holds 1 + w in float32, added once at load."""

    def __init__(self, size: int, eps: float, dtype, device):
        super().__init__(size, eps, torch.float32, device)  # the rows keep their dtype (forward)

    def _load(self, param, src, shard_id=None) -> None:
        copy_into(param.data, src.read().float() + 1.0, src.name)

    def forward(self, x: torch.Tensor, bf16: bool = False) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x, bf16)
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)
