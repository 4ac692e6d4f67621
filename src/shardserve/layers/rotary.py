"""Rotary position embedding (the rotate-half layout of Hugging Face), with linear, llama3, YaRN or
LongRoPE scaling or a GGUF's frequency divisors, over each head or its leading `rotary_dim` dims
(partial rotary: the tables are rotary_dim / 2 wide, and every kernel rotates as many dims as they
are wide)."""

from __future__ import annotations

import math

import torch
from torch import nn

from shardserve.config import RopeScaling
from shardserve.layers import cpu_ops, gpu_ops


def inverse_frequencies(dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """`dim`: the rotated width (rotary_dim under partial rotary)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if scaling is not None and scaling.kind in ("longrope", "freq_factors"):
        factors = scaling.long_factor if scaling.use_long else scaling.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    inv = 1.0 / (theta**exponents)
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "yarn":
        return _yarn(inv, dim, theta, scaling)
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv: torch.Tensor, dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: frequencies above the `beta_fast` rotation count kept, below `beta_slow` divided by
    the factor, a linear ramp between (as transformers computes it)."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolated = 1 - ramp
    return inv / s.factor * (1 - extrapolated) + inv * extrapolated


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin for every position; applied to q and k shaped [tokens, heads, dim]."""

    def __init__(self, head_dim: int, theta: float, max_positions: int,
                 scaling: RopeScaling | None, device: torch.device):
        super().__init__()
        inv = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        scale = scaling.cos_sin_scale if scaling is not None else 1.0
        self.register_buffer("cos", (freqs.cos() * scale).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scale).to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, 1, dim/2] tables for this step's positions, looked up once for all layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q [T, Hq, d] and k [T, Hk, d] together (one pass over both), in float32: their
    leading 2 x cos.shape[-1] dims, the rest passed through. On the CPU in float32 and on a GPU
    they are rotated in place (they are fresh projections) by one fused call."""
    if cpu_ops.rotary_(q, k, cos, sin) or gpu_ops.rotary_(q, k, cos, sin):
        return q, k
    hq, rd = q.shape[1], 2 * cos.shape[-1]
    x = torch.cat((q, k), dim=1)
    dtype = x.dtype
    x1, x2 = x[..., :rd].float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rd:].float()), dim=-1).to(dtype)
    return out[:, :hq], out[:, hq:]
