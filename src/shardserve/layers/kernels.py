"""The layers' C library (csrc/decode_loop.c, which includes quant_matmul.c, cpu_ops.c,
gate_up_silu.c and lora.c): the one place that loads it and declares its functions' ctypes
signatures.

quant_kernel (the block-quantized products), cpu_ops (the fused small operators) and
decode_loop (the layer loop) all call into this one library; declaring the signatures here keeps
them from drifting apart. Where it cannot be built, `load` raises KernelUnavailable and
shardserve.native has logged the process's one warning about the torch fallbacks.
"""

from __future__ import annotations

import ctypes
import functools

from shardserve import native
from shardserve.native import KernelUnavailable

__all__ = ["KernelUnavailable", "available", "load", "load_or_none"]

i64, ptr, c_int, c_float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float

# name: (argument types, result type); a None result is C's void.
SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    "qmatmul": ([c_int, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, c_int], c_int),
    "qdequant": ([c_int, ptr, i64, i64, i64, ptr, i64, ptr, c_int], c_int),
    "rms_norm_f32": ([ptr, i64, i64, i64, ptr, c_float, ptr, i64, c_int], None),
    "rms_norm_bf16": ([ptr, i64, i64, i64, ptr, c_float, ptr, c_int], c_int),
    "rotary_f32": ([ptr, i64, i64, ptr, i64, i64, i64, i64, i64, ptr, ptr, c_int], None),
    "silu_mul_f32": ([ptr, i64, i64, i64, ptr, c_int], None),
    "silu_mul_bf16": ([ptr, i64, i64, i64, ptr, c_int], c_int),
    "gelu_tanh_mul_f32": ([ptr, i64, i64, i64, ptr, c_int], None),
    "gelu_tanh_mul_bf16": ([ptr, i64, i64, i64, ptr, c_int], c_int),
    "qmatmul_bf16": ([ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, c_int], c_int),
    "qmatmul_bf16_silu": ([ptr, i64, i64, ptr, ptr, i64, i64, ptr, i64, c_int], c_int),
    "bf16_path": ([], c_int),
    "lora_shrink_f32": ([ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64, ptr, c_int], None),
    "lora_expand_f32": ([ptr, i64, ptr, ptr, ptr, i64, ptr, i64, i64, ptr, i64, ptr, i64, c_int], None),
    "rows_finite": ([ptr, i64, i64, i64, ptr, c_int], None),
    "rows_argmax": ([ptr, i64, i64, i64, ptr, c_int], None),
    "decode_layers": ([ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, ptr, c_int, ptr, ptr], c_int),
}
# Built only where the CPU has AVX-512 (csrc/logit_rows.c); elsewhere their callers keep numpy's.
AVX512_ONLY = frozenset({"rows_finite", "rows_argmax"})


@functools.cache
def load() -> ctypes.CDLL:
    """The compiled library with every signature declared; raises KernelUnavailable."""
    return bind(native.library("layers"))


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The layers' library (or a build made for another CPU, in the tests) with its functions' C
    signatures declared."""
    return native.declare(lib, SIGNATURES, AVX512_ONLY)


@functools.cache  # the fused operators ask on every call: a failure is not re-raised each time
def load_or_none() -> ctypes.CDLL | None:
    """The library, or None where it cannot be had (the caller runs its torch path)."""
    try:
        return load()
    except KernelUnavailable:
        return None


def available() -> str | None:
    """None where the library builds and loads here, else why not."""
    try:
        load()
    except KernelUnavailable as e:
        return str(e)
    return None
