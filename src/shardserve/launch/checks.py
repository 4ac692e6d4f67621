"""Flags checked against the model and this machine before any worker starts.

Each of these would otherwise fail (or be silently changed) on every rank after seconds of
imports and weight loading, and reach the user as a worker's traceback. Here it is one line
naming the flag. torch is imported only for a --device other than the CPU: the API process
never needs it otherwise.
"""

from __future__ import annotations

import math

from shardserve.config import DTYPE_BYTES, EngineConfig, ModelConfig
from shardserve.distributed.layout import Layout, LayoutError
from shardserve.kvcache.budget import kv_budget_message
from shardserve.layers.sharding import head_shard  # plain Python
from shardserve.loader.model_path import resolve_checkpoint
from shardserve.loader.weights import read_model_config


def check_dense(model: str | None, ep: int) -> None:
    """--ep-size on a dense model, refused before the layout's rank arithmetic (which would speak
    of "the 1 ranks the MoE layers span")."""
    if ep == 1:
        return
    ckpt = resolve_checkpoint(model)
    if not read_model_config(ckpt).num_experts:
        raise LayoutError(f"--ep-size {ep} needs a mixture-of-experts model; {ckpt.name} has no experts "
                          f"(it is dense: leave --ep-size out)")


def check_context(cfg: EngineConfig, model_cfg: ModelConfig) -> None:
    """A --max-model-len beyond the model's positions is refused, not clamped in silence."""
    limit = model_cfg.max_position_embeddings
    if cfg.max_model_len is not None and cfg.max_model_len > limit:
        raise LayoutError(f"--max-model-len {cfg.max_model_len} exceeds the model's context limit of {limit} tokens "
                          f"(max_position_embeddings): give at most {limit}, or leave it out")


def kv_page_bytes(cfg: EngineConfig, layout: Layout, model_cfg: ModelConfig) -> int:
    """Bytes of the largest KV page any rank holds (K and V, all its layers): the rank with the
    most layers and KV heads needs the most per page, and every rank keeps as many pages as it."""
    if cfg.pp_layer_partition:
        layers = max(cfg.pp_layer_partition)
    else:
        layers = math.ceil(model_cfg.num_layers / layout.pp)  # the even split puts the remainder first
    heads = max(head_shard(model_cfg.num_heads, model_cfg.num_kv_heads, layout.tp, r).num_kv
                for r in range(layout.tp))
    return 2 * layers * cfg.page_size * heads * model_cfg.head_dim * DTYPE_BYTES[cfg.dtype]


def check_kv_budget(cfg: EngineConfig, layout: Layout, model_cfg: ModelConfig) -> None:
    """--kv-cache-memory in bytes must hold one page (a fraction of free memory is sized on the
    rank, where the free memory is known)."""
    if cfg.num_pages is not None or cfg.kv_cache_memory <= 1:
        return
    per_page = kv_page_bytes(cfg, layout, model_cfg)
    if cfg.kv_cache_memory < per_page:
        raise LayoutError(kv_budget_message(cfg.kv_cache_memory, cfg.kv_cache_memory, per_page, cfg.page_size))


def check_device(device: str | None, layout: Layout) -> None:
    """--device naming something this torch or machine lacks (a CUDA device on a CPU-only build)."""
    if device is None or device == "cpu":
        return
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if dev.type != "cuda":
        return
    if torch.version.cuda is None:
        raise ValueError(f"--device {device}: this torch ({torch.__version__}) is a CPU-only build; use --device "
                         f"cpu, or install a CUDA build of torch")
    found = torch.cuda.device_count()
    needed = dev.index + 1 if dev.index is not None else layout.ranks_per_node
    if found < needed:
        raise ValueError(f"--device {device}: {needed} CUDA device{'s' if needed > 1 else ''} needed "
                         f"({layout.ranks_per_node} rank{'s' if layout.ranks_per_node > 1 else ''} on this "
                         f"machine), {found} visible")
