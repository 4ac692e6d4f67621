"""Products against block-quantized weights (csrc/quant_matmul.c), for the CPU.

Every product runs in C with 16-bit activations against the weight's blocks: Q4_0, Q4_1 and
Q8_0 in the x16 layout at every number of rows (`kernel_layout`); the K-quants below 10 rows,
and from there as a float GEMM on expanded weight rows (see the C files' headers). Float32
weights are F32 rows in the x16 layout (`float_weight`): exact float products, one order at
every number of rows, and the C decode loop. Under --dtype bfloat16 on the CPU the weights are
BF16 rows in the x16 layout (`bf16_weights`), on AMX tiles or AVX512-BF16 where the CPU has them.
"""

from __future__ import annotations

import torch

from shardserve.layers.kernels import KernelUnavailable, available, load
from shardserve.loader.quantized import BF16, X16, X16_FORMATS, QuantWeight, float_rows, interleave16

__all__ = ["KernelUnavailable", "available", "dequantize", "float_weight", "gate_up_silu", "kernel_layout", "linear",
           "load", "takes_bf16"]


def kernel_layout(w: QuantWeight) -> QuantWeight:
    """The weight as the kernels multiply it: Q4_0, Q4_1, Q8_0 and F32 rows interleaved 16 at a
    time (the x16 layout: faster at every batch size, and one arithmetic whatever the batch, so
    a request's tokens do not depend on what shares its step; see csrc/quant_x16.c). Other
    formats, and any weight where the kernels are unavailable, stay as they are."""
    if w.qtype in X16_FORMATS and available() is None:
        return interleave16(w)
    return w


def bf16_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a rank asked for bfloat16 keeps its weights as BF16 rows for these kernels, with
    float32 activations around them: on the CPU, where the kernels load. There the weights are
    half the bytes of float32 (what a one-row decode step reads) and run on AMX tiles or
    vdpbf16ps where the CPU has them (`bf16_path`); the layers and the C decode loop stay
    float32, the KV cache too unless the runner keeps it in bfloat16 (engine/model_runner.kv_cache_dtype).
    Elsewhere bfloat16 runs in torch, op by op."""
    return device.type == "cpu" and dtype == torch.bfloat16 and available() is None


BF16_PATHS = {0: "float32 activations", 1: "amx", 2: "avx512-bf16"}


def bf16_path() -> str:
    """How BF16 products run here: "amx" (AMX tiles, csrc/quant_amx.c) or "avx512-bf16"
    (vdpbf16ps, csrc/quant_x16_float.c), both with bfloat16 activations, else "float32
    activations". Chosen once when the library loads: by the CPU, the AMX probe, and
    SHARDSERVE_NO_AMX / SHARDSERVE_FLOAT32_ACTIVATIONS."""
    return BF16_PATHS[load().bf16_path()] if available() is None else BF16_PATHS[0]


def bf16_activations() -> bool:
    """Whether BF16 products round their activations to bfloat16 here (see bf16_path)."""
    return bf16_path() != BF16_PATHS[0]


def takes_bf16(segments: tuple[tuple[int, QuantWeight], ...]) -> bool:
    """Whether `linear` takes these segments' activations already bfloat16 (rounded by the op
    before, as the kernel would round them: cpu_ops.silu_mul(bf16=True)), skipping the product's
    own pass over them: every segment BF16 rows, on vdpbf16ps, or on AMX tiles where the columns
    are whole chunks of 32 (a tile reads 32 a row; csrc qmatmul_bf16)."""
    path = bf16_path()
    return path != BF16_PATHS[0] and all(w.qtype == X16 | BF16 and (path != BF16_PATHS[1] or w.cols % 32 == 0)
                                         for _, w in segments)


def float_weight(weight: torch.Tensor | None) -> QuantWeight | None:
    """A CPU float32 [out, in] weight as F32 rows in the x16 layout for these kernels (a copy:
    the caller drops the weight), or None where they do not take it (another device or dtype,
    `in` not a multiple of 8, no compiler).

    One order of multiply-adds per output at every batch size (batch-invariant, as the block
    formats), 16 lanes wide where the CPU has AVX-512; the decode loop then runs a float
    checkpoint's layers in one call (the README's measurements have the figures)."""
    if (weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2
            or weight.shape[1] % 8 or available() is not None):
        return None
    return kernel_layout(float_rows(weight))


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
    rc = load().qdequant(w.qtype, w.data.data_ptr(), w.data.stride(0), w.rows, w.cols,
                         None if rows is None else rows.data_ptr(), count, out.data_ptr(), torch.get_num_threads())
    _check(rc, "dequantize", w)
    return out


def _kernel(x: torch.Tensor, w: QuantWeight, out: torch.Tensor) -> None:
    """out [M, w.rows] (rows may be strided) = x [M, K] . w^T."""
    rc = load().qmatmul(w.qtype, w.data.data_ptr(), w.data.stride(0), w.rows, w.cols, x.data_ptr(), x.shape[0],
                        x.stride(0), out.data_ptr(), out.stride(0), torch.get_num_threads())
    _check(rc, "qmatmul", w)


def _bf16_kernel(x: torch.Tensor, w: QuantWeight, out: torch.Tensor) -> None:
    """_kernel for bfloat16 activations (takes_bf16)."""
    rc = load().qmatmul_bf16(w.data.data_ptr(), w.data.stride(0), w.rows, w.cols, x.data_ptr(), x.shape[0],
                             x.stride(0), out.data_ptr(), out.stride(0), torch.get_num_threads())
    if rc == 3:
        raise RuntimeError("qmatmul_bf16: not a bfloat16-activation path here (takes_bf16 said it was)")
    _check(rc, "qmatmul_bf16", w)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [.., K] as the C entries read it: rows of unit inner stride. To them a bfloat16 row stride
    of 0 means their own padded rows, so bfloat16 rows closer than K apart are copied too."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1 or (x2.dtype == torch.bfloat16 and x2.stride(0) < x2.shape[1]):
        x2 = x2.contiguous()
    return x2


def linear(x: torch.Tensor, segments: tuple[tuple[int, QuantWeight], ...], out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [.., K] float32 (or bfloat16 where takes_bf16) . W^T (+ bias), W given as row segments
    (offset, QuantWeight) that together cover `out_features` rows (a fused q/k/v may mix formats)."""
    lead = x.shape[:-1]
    bf16 = x.dtype == torch.bfloat16
    if x.dtype != torch.float32 and not (bf16 and takes_bf16(segments)):
        raise TypeError(f"these linear layers take float32 activations, got {x.dtype}")
    x2 = _rows(x)
    y = torch.empty(x2.shape[0], out_features, dtype=torch.float32)
    for offset, w in segments:
        (_bf16_kernel if bf16 else _kernel)(x2, w, y[:, offset: offset + w.rows])
    if bias is not None:
        y += bias
    return y.reshape(*lead, out_features)


def gate_up_silu(x: torch.Tensor, segments: tuple[tuple[int, QuantWeight], ...]) -> torch.Tensor | None:
    """silu(x . gate^T) * (x . up^T) rounded to bfloat16 [.., I], for a down product that takes
    bfloat16 rows (takes_bf16): a gated MLP's gate/up product (one BF16 segment, the gate rows then
    the up rows) with its SiLU in the product's own epilogue (csrc/gate_up_silu.c), the same bits
    as `linear` then cpu_ops.silu_mul(bf16=True). None, having done nothing, where the kernel's
    path is another (neither vdpbf16ps nor AMX with columns in whole chunks of 32, several
    segments, I not a multiple of 16); x float32, or bfloat16 rows already rounded (cpu_ops.rms_norm
    with bf16)."""
    w = segments[0][1]
    # The path (vdpbf16ps, AMX, or neither) the C entry checks itself, answering 3.
    if len(segments) != 1 or w.qtype != X16 | BF16 or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    x2, bf16 = _rows(x), x.dtype == torch.bfloat16
    out = torch.empty(x2.shape[0], w.rows // 2, dtype=torch.bfloat16)
    rc = load().qmatmul_bf16_silu(w.data.data_ptr(), w.rows, w.cols, None if bf16 else x2.data_ptr(),
                                  x2.data_ptr() if bf16 else None, x2.shape[0], x2.stride(0), out.data_ptr(),
                                  out.stride(0), torch.get_num_threads())
    if rc == 3:
        return None
    _check(rc, "qmatmul_bf16_silu", w)
    return out.view(*x.shape[:-1], w.rows // 2)
