"""Triton kernels for the small operators on a GPU: RMSNorm, rotary and gated SiLU, one launch
each instead of torch's several (layers/gpu_ops.py calls them where the tensors are on CUDA).
The arithmetic is the torch formulas' (float32 inside, rounded where they round), and the same
source runs on CPU tensors under Triton's interpreter, which is how CI tests it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(x, stride_x, w, out, stride_o, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    m = i < n
    v = tl.load(x + row * stride_x + i, mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, 0) / n + eps)
    y = (v * inv).to(out.dtype.element_ty)  # rounded to the input's dtype, then scaled (as HF)
    g = tl.load(w + i, mask=m, other=0.0)
    tl.store(out + row * stride_o + i, (y * g).to(out.dtype.element_ty), mask=m)


@triton.jit
def _silu_mul(x, stride_x, out, stride_o, inter, BLOCK: tl.constexpr):
    row, col = tl.program_id(0), tl.program_id(1)
    i = col * BLOCK + tl.arange(0, BLOCK)
    m = i < inter
    gate = tl.load(x + row * stride_x + i, mask=m, other=0.0).to(tl.float32)
    up = tl.load(x + row * stride_x + inter + i, mask=m, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(out.dtype.element_ty)
    tl.store(out + row * stride_o + i, (act * up).to(out.dtype.element_ty), mask=m)


@triton.jit
def _rotary(x, stride_t, heads, head_dim, cos, sin, half, BLOCK: tl.constexpr):
    t, h = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, BLOCK)
    m = i < half
    base = x + t * stride_t + h * head_dim
    x1 = tl.load(base + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + i, mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos + t * half + i, mask=m, other=0.0)
    s = tl.load(sin + t * half + i, mask=m, other=0.0)
    tl.store(base + i, (x1 * c - x2 * s).to(x.dtype.element_ty), mask=m)
    tl.store(base + half + i, (x2 * c + x1 * s).to(x.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm[(x2.shape[0],)](x2, x2.stride(0), weight, out, out.stride(0), x2.shape[1], eps,
                                  BLOCK=triton.next_power_of_2(x2.shape[1]))
    return out.view(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    g2 = gate_up.reshape(-1, gate_up.shape[-1])
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    inter = g2.shape[1] // 2
    out = torch.empty(g2.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    if g2.shape[0]:
        _silu_mul[(g2.shape[0], triton.cdiv(inter, block))](g2, g2.stride(0), out, out.stride(0), inter, BLOCK=block)
    return out.view(*gate_up.shape[:-1], inter)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, H, d] (heads packed in each row) in place by cos/sin [T, rd/2] (float32): each
    head's leading rd dims (rd < d under partial rotary)."""
    t, h, d = x.shape
    half = cos.shape[-1]
    assert x.stride(2) == 1 and x.stride(1) == d and cos.is_contiguous() and sin.is_contiguous() and 2 * half <= d
    if t:
        _rotary[(t, h)](x, x.stride(0), h, d, cos, sin, half, BLOCK=triton.next_power_of_2(half))
