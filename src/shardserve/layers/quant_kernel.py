"""Products against block-quantized weights (csrc/quant_matmul.c), for the CPU.

Every product runs in C: below 16 activation rows (decode) against the weight's blocks with
16-bit activations, from 16 rows on (prefill, many streams) as a float GEMM on weight rows
expanded 16 at a time (see the C file's header for both). Float32 weights take the same paths
as F32 rows (`float_weight`): exact float products, and the C decode loop.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from shardserve.loader.quantized import QuantWeight, float_rows
from shardserve.native import KernelUnavailable, load_library

__all__ = ["KernelUnavailable", "available", "dequantize", "float_weight", "linear", "load"]

# decode_loop.c includes quant_matmul.c and cpu_ops.c: one library for the layers' kernels.
SOURCE = Path(__file__).with_name("csrc") / "decode_loop.c"


@functools.cache
def load() -> ctypes.CDLL:
    """The compiled kernel library; raises KernelUnavailable with the reason."""
    lib = load_library(SOURCE)
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.qmatmul.argtypes = [c_int, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, c_int]
    lib.qdequant.argtypes = [c_int, ptr, i64, i64, ptr, i64, ptr, c_int]
    lib.qmatmul.restype = lib.qdequant.restype = c_int
    return lib


def available() -> str | None:
    """None where the kernel builds and loads here, else why not."""
    try:
        load()
    except KernelUnavailable as e:
        return str(e)
    return None


def float_weight(weight: torch.Tensor | None) -> QuantWeight | None:
    """A CPU float32 [out, in] weight as F32 rows for these kernels (the same memory), or None
    where they do not take it (another device or dtype, `in` not a multiple of 8, no compiler).

    Measured against oneDNN's packed copy (2 threads, AVX2): one row 1.3-1.4x faster, 32 rows
    0.8-0.9x, 512 rows 1.15-1.2x; and the decode loop then runs a float checkpoint's layers in
    one call."""
    if (weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2
            or weight.shape[1] % 8 or available() is not None):
        return None
    return float_rows(weight)


def _check(rc: int, what: str, w: QuantWeight) -> None:
    if rc == 1:
        raise ValueError(f"{what}: {w.name} weight with {w.cols} columns is not supported")
    if rc != 0:
        raise MemoryError(f"{what}: out of memory for the quantized activations")


def dequantize(w: QuantWeight, rows: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 copy of the weight's rows (all, or those `rows` names: int64 indices)."""
    count = w.rows if rows is None else rows.numel()
    if out is None:
        out = torch.empty(count, w.cols, dtype=torch.float32)
    assert out.is_contiguous() and out.shape == (count, w.cols)
    if rows is not None:
        rows = rows.to(torch.int64).contiguous()
    rc = load().qdequant(w.qtype, w.data.data_ptr(), w.data.stride(0), w.cols,
                         None if rows is None else rows.data_ptr(), count, out.data_ptr(), torch.get_num_threads())
    _check(rc, "dequantize", w)
    return out


def _kernel(x: torch.Tensor, w: QuantWeight, out: torch.Tensor) -> None:
    """out [M, w.rows] (rows may be strided) = x [M, K] . w^T."""
    rc = load().qmatmul(w.qtype, w.data.data_ptr(), w.data.stride(0), w.rows, w.cols, x.data_ptr(), x.shape[0],
                        x.stride(0), out.data_ptr(), out.stride(0), torch.get_num_threads())
    _check(rc, "qmatmul", w)


def linear(x: torch.Tensor, segments: tuple[tuple[int, QuantWeight], ...], out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [.., K] float32 . W^T (+ bias), W given as row segments (offset, QuantWeight) that
    together cover `out_features` rows (a fused q/k/v may mix formats)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.float32:
        raise TypeError(f"quantized linear layers take float32 activations, got {x2.dtype}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape[0], out_features, dtype=torch.float32)
    for offset, w in segments:
        _kernel(x2, w, y[:, offset: offset + w.rows])
    if bias is not None:
        y += bias
    return y.reshape(*lead, out_features)
