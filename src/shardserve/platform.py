"""The one place that decides device and collective backend, so no layer names 'cpu' or 'cuda'."""

from __future__ import annotations

import torch


def pick_device(requested: str | None = None, local_rank: int = 0) -> torch.device:
    """The device for this rank: the requested one, else `cuda:{local_rank}` if CUDA exists, else CPU."""
    if requested:
        dev = torch.device(requested)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", local_rank)
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def pick_dtype(requested: str, checkpoint: str, device: torch.device, gguf: bool) -> tuple[str, str]:
    """The dtype a rank computes in, and why. `auto` (vLLM's meaning, but a float32 checkpoint
    stays float32): on a GPU the checkpoint's own dtype, float16 where the GPU lacks bfloat16;
    on the CPU float32, the precision its kernels (paged attention, the C decode loop, the
    quantized products) run in. A GGUF's floats are float32 on the CPU, bfloat16 on a GPU."""
    gpu_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    if requested == "bfloat16" and device.type == "cuda" and not gpu_bf16:
        raise ValueError(f"--dtype bfloat16: {torch.cuda.get_device_name(device)} has no bfloat16; use float16")
    if requested != "auto":
        return requested, "asked"
    if device.type != "cuda":
        return "float32", "auto: the CPU kernels run in float32"
    own = "bfloat16" if gguf else checkpoint
    if own not in ("float32", "bfloat16", "float16"):
        own = "bfloat16"
    if own == "bfloat16" and not gpu_bf16:
        return "float16", f"auto: the checkpoint's bfloat16, which {torch.cuda.get_device_name(device)} lacks"
    return own, "auto: a GGUF's floats" if gguf else "auto: the checkpoint's own"


def triton_module(name: str, device: torch.device):
    """Import a module of Triton kernels for `device`. On the CPU they run under Triton's
    interpreter, which must be on before the kernels are defined; raises ImportError without Triton."""
    import importlib
    import os

    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        # Triton's own library functions are made interpreted or compiled when it is first
        # imported: imported before (torch._dynamo imports it), the interpreter cannot run them.
        if not isinstance(tl.sum, InterpretedFunction):
            raise ImportError("Triton was imported before its interpreter was turned on: set TRITON_INTERPRET=1 in "
                              "the environment to run Triton's kernels on the CPU")
    return importlib.import_module(name)


def collective_backend(device: torch.device) -> str:
    """NCCL for GPU tensors, gloo otherwise (gloo also carries control messages everywhere)."""
    return "nccl" if device.type == "cuda" else "gloo"


def available_memory(device: torch.device) -> int:
    """Bytes free on the device now: CUDA's free memory, or the OS's MemAvailable on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM), file-backed pages of mmapped checkpoints
    included. Not ru_maxrss: Linux carries that across exec, so a spawned worker would report
    its parent's peak."""
    return _status_mb("VmHWM")


def anon_rss_mb() -> float:
    """Resident memory the process owns (RssAnon): tensors, not the page cache of a checkpoint."""
    return _status_mb("RssAnon")
