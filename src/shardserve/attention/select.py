"""The one place that decides which attention backend a model runner uses, before any weight loads.

`auto`: on the CPU, the C kernel where the dtype is float32 and it builds, else torch SDPA; on a
GPU, Triton's paged kernels where Triton imports (and the model has no sliding window), else torch
SDPA (said in a warning, not silently). Asked by name, a backend that cannot run is an error
naming the flag.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from shardserve.attention import cpu_kernel
from shardserve.attention.backend import AttentionBackend
from shardserve.attention.cpu_backend import CpuBackend
from shardserve.attention.torch_backend import TorchBackend
from shardserve.attention.triton_backend import TritonBackend
from shardserve.platform import triton_module

log = logging.getLogger(__name__)


class BackendUnavailable(ValueError):
    pass


def triton_kernels(device: torch.device) -> ModuleType:
    """attention/triton_kernels.py, importable only with Triton installed (on the CPU, under
    Triton's interpreter: platform.triton_module)."""
    try:
        return triton_module("shardserve.attention.triton_kernels", device)
    except ImportError as e:
        raise BackendUnavailable(f"--attention-backend triton needs Triton (pip install triton): {e}") from e


def _cpu(device: torch.device, dtype: torch.dtype, choice: str, batch_invariant: bool | None) -> CpuBackend | None:
    if not cpu_kernel.supports(device, dtype):
        if choice == "cpu":
            raise BackendUnavailable(f"--attention-backend cpu needs a CPU device and float32, got {device} and "
                                     f"{str(dtype).removeprefix('torch.')}")
        return None
    try:
        cpu_kernel.load()
    except cpu_kernel.KernelUnavailable as e:
        if choice == "cpu":
            raise
        log.warning("decode attention falls back to torch SDPA: %s", e)
        return None
    return CpuBackend(batch_invariant is not False)


def _triton_lacks(window: int | None, softcap: float | None) -> str | None:
    """What the model needs that the Triton kernels lack, in words, or None."""
    if window:
        return (f"no sliding-window attention (the model's window is {window} tokens): use cpu or torch, or "
                f"--max-model-len {window} or less")
    if softcap:
        return f"no attention logit softcapping (the model caps its scores at {softcap}): use cpu or torch"
    return None


def choose_backend(choice: str, device: torch.device, dtype: torch.dtype,
                   batch_invariant: bool | None = None, window: int | None = None,
                   softcap: float | None = None) -> AttentionBackend:
    """`batch_invariant` None: wherever the backend offers it; True: required; False: off.
    `window`: the model's sliding window where the served context exceeds it; `softcap`: its
    attention scores' tanh cap (Gemma 2). Triton's kernels have neither: `auto` takes torch SDPA
    then, and says so."""
    lacks = _triton_lacks(window, softcap)
    if lacks and choice == "triton":
        raise BackendUnavailable(f"--attention-backend triton has {lacks}")
    if lacks and choice == "auto" and device.type == "cuda":
        log.warning("attention: torch SDPA (the Triton kernels have %s)", lacks.split(":")[0])
        choice = "torch"
    backend: AttentionBackend | None = None
    if choice in ("auto", "cpu") and device.type == "cpu":
        backend = _cpu(device, dtype, choice, batch_invariant)
    elif choice == "cpu":
        _cpu(device, dtype, choice, batch_invariant)  # raises: the C kernel runs on the CPU only
    elif choice == "triton" or (choice == "auto" and device.type == "cuda"):
        if device.type == "cpu" and dtype != torch.float32:  # the interpreter reads half precision wrongly
            raise BackendUnavailable(f"--attention-backend triton on the CPU runs under Triton's interpreter, "
                                     f"float32 only, not {str(dtype).removeprefix('torch.')}")
        try:
            backend = TritonBackend(triton_kernels(device), interpreted=device.type == "cpu")
        except BackendUnavailable as e:
            if choice == "triton":
                raise
            log.warning("attention falls back to torch SDPA (gathered pages): %s", e)
    backend = backend or TorchBackend()
    if batch_invariant and not getattr(backend, "batch_invariant", False):
        raise BackendUnavailable(f"--batch-invariant needs the CPU attention kernel (a CPU device, float32, "
                                 f"--attention-backend auto or cpu), got {device}, "
                                 f"{str(dtype).removeprefix('torch.')}, {choice}")
    return backend
