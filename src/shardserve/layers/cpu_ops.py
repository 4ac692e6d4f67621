"""The fused small operators (csrc/cpu_ops.c): RMSNorm, rotary, gated SiLU in one call each;
and the sampler's passes over a step's logits (csrc/logit_rows.c): finite rows, argmax.

Each function answers None where it does not apply (not a CPU float32 tensor with unit inner
stride, or no compiler here: shardserve.native then warns once), and the caller runs its torch
formula instead; the operators agree with it to float32 rounding (tests/unit/test_quantized.py),
the logit passes exactly (tests/unit/test_logit_rows.py).
"""

from __future__ import annotations

import torch

from shardserve.layers.kernels import load_or_none as _lib


def cpu_float32(*ts: torch.Tensor) -> bool:
    """Whether the C float32 operators take these tensors: on the CPU, float32, unit inner stride."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in ts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, bf16: bool = False) -> torch.Tensor | None:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim, or None (use torch). `bf16`: rounded
    to bfloat16 as a product on bfloat16 weights rounds its activations, for one that takes them
    so (quant_kernel.takes_bf16): the same bits it would have used, without a float32 copy."""
    if not cpu_float32(x, weight) or (lib := _lib()) is None:
        return None
    x2 = x.reshape(-1, x.shape[-1])  # a view or a contiguous copy: unit stride either way
    out = torch.empty(x2.shape, dtype=torch.bfloat16 if bf16 else torch.float32)
    args = (x2.data_ptr(), x2.shape[0], x2.stride(0), x2.shape[1], weight.data_ptr(), eps, out.data_ptr())
    if bf16:
        if lib.rms_norm_bf16(*args, torch.get_num_threads()):
            raise MemoryError("rms_norm: out of memory for a row buffer")
    else:
        lib.rms_norm_f32(*args, out.stride(0), torch.get_num_threads())
    return out.view(x.shape)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate q [T, Hq, d] and k [T, Hk, d] in place (heads packed in each row), each head's
    leading 2 x cos.shape[-1] dims; False where the kernel does not apply and nothing was done."""
    if not cpu_float32(q, k, cos, sin) or (lib := _lib()) is None:
        return False
    t, hq, d = q.shape
    if q.stride(1) != d or k.stride(1) != d or not cos.is_contiguous() or not sin.is_contiguous():
        return False
    lib.rotary_f32(q.data_ptr(), q.stride(0), hq, k.data_ptr(), k.stride(0), k.shape[1], t, d, 2 * cos.shape[-1],
                   cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())
    return True


def silu_mul(gate_up: torch.Tensor, bf16: bool = False, activation: str = "silu") -> torch.Tensor | None:
    """act(gate) * up where gate_up [.., 2I] holds gate then up, act SiLU or (`activation`
    "gelu_pytorch_tanh") GELU's tanh approximation; or None (use torch). `bf16`: rounded to
    bfloat16 as a product on bfloat16 weights rounds its activations, for one that takes them so
    (quant_kernel.takes_bf16): the same bits it would have used."""
    if not cpu_float32(gate_up) or (lib := _lib()) is None:
        return None
    g2 = gate_up.reshape(-1, gate_up.shape[-1])
    inter = g2.shape[1] // 2
    out = torch.empty(g2.shape[0], inter, dtype=torch.bfloat16 if bf16 else torch.float32)
    name = {"silu": "silu_mul", "gelu_pytorch_tanh": "gelu_tanh_mul"}[activation]
    if bf16:
        if getattr(lib, f"{name}_bf16")(g2.data_ptr(), g2.shape[0], g2.stride(0), inter, out.data_ptr(),
                                        torch.get_num_threads()):
            raise MemoryError(f"{name}: out of memory for a row buffer")
    else:
        getattr(lib, f"{name}_f32")(g2.data_ptr(), g2.shape[0], g2.stride(0), inter, out.data_ptr(),
                                    torch.get_num_threads())
    return out.view(*gate_up.shape[:-1], inter)


def _logit_rows(logits: torch.Tensor):
    """The library where it takes these logits ([rows, vocab] CPU float32, unit inner stride, a
    vocabulary) and has the passes (an AVX-512 build), else None."""
    if logits.dim() != 2 or logits.shape[1] == 0 or not cpu_float32(logits):
        return None
    lib = _lib()
    return lib if lib is not None and hasattr(lib, "rows_argmax") else None


def rows_finite(logits: torch.Tensor) -> torch.Tensor | None:
    """[rows] bool: whether each row is all finite (no NaN, no infinity), in one pass over the
    rows on torch's threads; or None (use torch)."""
    if (lib := _logit_rows(logits)) is None:
        return None
    out = torch.empty(logits.shape[0], dtype=torch.bool)
    lib.rows_finite(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr(),
                    torch.get_num_threads())
    return out


def rows_argmax(logits: torch.Tensor) -> list[int] | None:
    """Each row's argmax, the first of equal maxima, a NaN counting as the largest (numpy's and
    torch's), in one pass over the rows on torch's threads; or None (use torch)."""
    if (lib := _logit_rows(logits)) is None:
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.rows_argmax(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr(),
                    torch.get_num_threads())
    return out.tolist()
