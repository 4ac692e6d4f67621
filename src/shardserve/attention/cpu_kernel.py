"""The CPU decode-attention kernel (csrc/paged_decode.c), built and loaded by `shardserve.native`.

Decode attention dominates a CPU decode step when done with torch ops: every layer gathers each
sequence's pages into a padded tensor and SDPA reads that copy again. The C kernel reads K/V in
place from the pages. Where no compiler works, `load()` says why and the engine keeps the torch
path. attention/ sits below layers/, so this library's binding is its own, not layers.kernels'.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from shardserve import native
from shardserve.native import KernelUnavailable

__all__ = ["KernelUnavailable", "bf16_cache", "bind", "load", "paged_decode", "supports", "write_rows"]

SOURCE = next(lib.source for lib in native.LIBRARIES if lib.name == "attention")


@functools.cache
def load() -> ctypes.CDLL:
    """The compiled kernel library (its own, apart from the layers'); raises KernelUnavailable
    with the reason, after shardserve.native's one warning about the fallbacks."""
    return bind(native.library("attention"))


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_DECODE = ([_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64,
            ctypes.c_float, ctypes.c_float, ctypes.c_int], ctypes.c_int)
SIGNATURES = {"paged_decode_f32": _DECODE, "paged_decode_bf16": _DECODE,
              "kv_write": ([_PTR, _I64, _I64, _I64, _PTR, _I64, ctypes.c_int, _PTR, ctypes.c_int], ctypes.c_int),
              "paged_bf16_width": ([_I64], ctypes.c_int)}
# Built where the CPU has AVX512-BF16 (a bfloat16 cache's kernel and the widths it reads).
BF16_ONLY = frozenset({"paged_decode_bf16", "paged_bf16_width"})


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The attention library (or a build made for another CPU, in the tests) with its entry
    points' C signatures declared."""
    return native.declare(lib, SIGNATURES, BF16_ONLY)


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32


@functools.cache  # asked on every call of paged_decode with such a cache
def bf16_cache(widths: tuple[int, int]) -> bool:
    """Whether the kernel reads a bfloat16 KV cache of these K/V widths here: built where the CPU
    has AVX512-BF16 (scores on vdpbf16ps, half the bytes a step reads), for heads whose K and V
    widths are equal and the kernel takes (paged_bf16_width: multiples of 32 up to 256; not
    latent attention's one wide vector)."""
    try:
        lib = load()
    except KernelUnavailable:
        return False
    return hasattr(lib, "paged_decode_bf16") and widths[0] == widths[1] and bool(lib.paged_bf16_width(widths[0]))


def function(cache_dtype: torch.dtype) -> ctypes._CFuncPtr:
    """The kernel for caches of that dtype (float32, or bfloat16 where bf16_cache)."""
    return load().paged_decode_bf16 if cache_dtype == torch.bfloat16 else load().paged_decode_f32


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, kv_of_q: torch.Tensor, page_size: int, scale: float,
                 out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                 skips: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """q: [B, H, D] float32 (rows may be strided); caches [slots, Hkv, D], float32 or (where
    bf16_cache) bfloat16; block_tables [B, P] and
    context_lens [B] int64 (0 allowed: zero out rows); kv_of_q [H] int64. Writes and returns
    out [B, H, D] (contiguous). With `lse` (contiguous float32 [B, H]) also writes each row's
    log(sum_t exp(scale * q . k_t)), -inf for an empty context, for merging partial attentions
    over disjoint key sets: out = sum_i out_i * exp(lse_i - logsumexp_i(lse_i)). `skips` (int64
    [B], a sliding window: PagedDecode.skips) masks each row's first skips[b] keys. `softcap` > 0
    bounds each scaled score s to softcap * tanh(s / softcap) (Gemma 2's logit softcapping)."""
    b, h, d = q.shape
    # A cache the kernel cannot read is an error here, never bytes read as another dtype.
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"paged_decode: caches of {k_cache.dtype} and {v_cache.dtype}; float32 or bfloat16 both")
    if k_cache.dtype == torch.bfloat16 and not bf16_cache((d, d)):
        raise ValueError(f"paged_decode: no bfloat16 cache of {d}-wide heads here (bf16_cache)")
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.is_contiguous()
    if out is None:
        out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    assert out.is_contiguous() and out.shape == (b, h, d)
    if lse is not None:
        assert lse.is_contiguous() and lse.dtype == torch.float32 and lse.shape == (b, h)
    rc = function(k_cache.dtype)(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], context_lens.data_ptr(), None if skips is None else skips.data_ptr(),
        kv_of_q.data_ptr(), out.data_ptr(),
        None if lse is None else lse.data_ptr(), b, h, k_cache.shape[1], d, page_size, scale, softcap,
        torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged_decode: out of memory for attention scores")
    return out


def write_rows(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> bool:
    """cache[slots] = x rounded to the cache's dtype, as `index_copy_` would, on every thread:
    x [T, Hkv, D] float32 with packed heads (rows may be strided), the cache [slots, Hkv, D]
    float32 or bfloat16 on the CPU, slots int64. False where these do not apply (nothing done)."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or cache.dtype not in (torch.float32, torch.bfloat16)
            or x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2] or not cache.is_contiguous()
            or slots.dtype != torch.int64 or not slots.is_contiguous() or cache.shape[1:] != x.shape[1:]):
        return False
    try:
        lib = load()
    except KernelUnavailable:
        return False
    rc = lib.kv_write(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1] * x.shape[2], cache.data_ptr(),
                      cache.shape[0], int(cache.dtype == torch.bfloat16), slots.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise IndexError(f"KV cache write: a slot outside the cache's {cache.shape[0]} rows")
    return True
