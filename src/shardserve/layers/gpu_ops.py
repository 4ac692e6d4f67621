"""The small operators on a GPU through Triton (layers/triton_ops.py), the way layers/cpu_ops.py
serves the CPU: each function answers None (or False) where it does not apply (not a CUDA tensor,
or no Triton), and the caller runs its torch formula. Triton is imported on first CUDA use."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from shardserve.platform import triton_module


@functools.cache
def _ops() -> ModuleType | None:
    try:
        return triton_module("shardserve.layers.triton_ops", torch.device("cuda"))
    except ImportError:
        return None


def _on_gpu(*ts: torch.Tensor) -> ModuleType | None:
    return _ops() if all(t.is_cuda for t in ts) else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    return ops.rms_norm(x, weight, eps) if (ops := _on_gpu(x, weight)) else None


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    return ops.silu_mul(gate_up) if (ops := _on_gpu(gate_up)) else None


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """q [T, Hq, d], k [T, Hk, d] rotated in place; cos/sin [T, 1, d/2] as Rotary.cos_sin gives."""
    if not (ops := _on_gpu(q, k)) or q.stride(1) != q.shape[2] or k.stride(1) != k.shape[2]:
        return False
    cos, sin = cos.reshape(cos.shape[0], -1).float().contiguous(), sin.reshape(sin.shape[0], -1).float().contiguous()
    ops.rotary_(q, cos, sin)
    ops.rotary_(k, cos, sin)
    return True
