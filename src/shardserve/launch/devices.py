"""Where the ranks will compute, as far as the API process can know it without torch: the GPUs
this process may use, and the bytes of one KV cache value."""

from __future__ import annotations

import os

from shardserve.config import DTYPE_BYTES, EngineConfig


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use, known without torch: the driver's list, narrowed by
    CUDA_VISIBLE_DEVICES where set."""
    try:
        found = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    listed = [d.strip() for d in visible.split(",") if d.strip()]
    # CUDA stops at the first entry that is invalid (such as -1): only those before it count.
    valid = next((i for i, d in enumerate(listed) if d.startswith("-")), len(listed))
    return min(found, valid)


def kv_value_bytes(cfg: EngineConfig) -> int:
    """Bytes of one KV cache value on the ranks, at most (the up-front checks' count, made
    without torch): bfloat16 on the CPU keeps a float32 KV cache unless the rank finds the
    kernels for a bfloat16 one (engine.model_runner.kv_cache_dtype: AVX512-BF16 and the heads'
    width), so there it counts 4, and 2 only where the ranks run on CUDA (named, or left to the
    default with a GPU visible); --kv-cache-dtype, where given, counts as asked."""
    if cfg.kv_cache_dtype != "auto":  # asked for: had, or refused on the ranks before loading
        return DTYPE_BYTES[cfg.kv_cache_dtype]
    device = cfg.device or ("cuda" if visible_gpus() else "cpu")
    if cfg.dtype == "bfloat16" and not device.startswith("cuda"):
        return 4
    return DTYPE_BYTES[cfg.dtype]
