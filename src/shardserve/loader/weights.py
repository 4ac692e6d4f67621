"""Fill a model's parameters from a checkpoint, tensor by tensor, through each layer's hook."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from tqdm import tqdm

from shardserve.config import EngineConfig, ModelConfig
from shardserve.loader.model_path import Checkpoint
from shardserve.loader.source import Bf16Source, Int8Source, TensorSource

if TYPE_CHECKING:
    from torch import nn


def read_model_config(ckpt: Checkpoint) -> ModelConfig:
    if ckpt.is_gguf:
        from shardserve.loader.gguf_metadata import read_gguf_config

        return ModelConfig.from_dict(read_gguf_config(ckpt.path))
    return ModelConfig.from_dir(ckpt.path)


def resolve_dtype(cfg: EngineConfig, ckpt: Checkpoint, model_cfg: ModelConfig | None = None) -> EngineConfig:
    """`cfg` with --dtype auto replaced by the dtype the ranks compute in (platform.pick_dtype),
    and logged. Each process that computes resolves it (the engine core, a follower rank, a model
    runner built alone: a no-op once resolved); the API process never does, it has no torch."""
    if cfg.dtype == "float16" and (arch := (model_cfg or read_model_config(ckpt)).architecture) in FLOAT16_UNSTABLE:
        raise ValueError(f"--dtype float16: {arch}'s activations overflow float16 (vLLM refuses it too): use "
                         "bfloat16 or float32")
    if cfg.dtype != "auto":
        return cfg
    from shardserve.platform import pick_device, pick_dtype  # torch: imported only when resolving

    device = pick_device(cfg.device)
    # The checkpoint's own dtype matters only on a GPU: not read elsewhere.
    if device.type == "cuda":
        model_cfg = model_cfg or read_model_config(ckpt)
    own = model_cfg.torch_dtype if device.type == "cuda" else "float32"
    dtype, why = pick_dtype(cfg.dtype, own, device, ckpt.is_gguf)
    if dtype == "float16" and model_cfg.architecture in FLOAT16_UNSTABLE:  # (only on a GPU)
        dtype, why = "float32", f"auto: {why}, but {model_cfg.architecture}'s activations overflow float16"
    logging.getLogger(__name__).info("dtype %s (%s)", dtype, why)
    return dataclasses.replace(cfg, dtype=dtype)


# Architectures whose activations overflow float16 (vLLM's list, where it has these).
FLOAT16_UNSTABLE = frozenset({"Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"})


def checkpoint_sources(ckpt: Checkpoint, quantization: str = "none") -> tuple[Iterable[TensorSource], int]:
    """The checkpoint's tensors as lazy sources, and how many there are (for the progress bar).
    `quantization` (QUANTIZATION_MODES, already checked against the checkpoint, or "bf16"):
    "auto" offers a GGUF's blocks as they are, "int8" offers float weights quantized to Q8_0,
    "bf16" offers them as bfloat16 rows (--dtype bfloat16 on the CPU: ModelRunner decides)."""
    if ckpt.is_gguf:
        from shardserve.loader.gguf_loader import gguf_sources

        sources = gguf_sources(ckpt.path, keep_quantized=quantization == "auto")
        if quantization == "bf16":  # the GGUF's weights expanded, then offered as bfloat16 rows
            return [Bf16Source(src) for src in sources], len(sources)
        return sources, len(sources)
    from shardserve.loader.safetensors_loader import count_tensors, iter_safetensors

    sources = iter_safetensors(ckpt.path)
    if quantization == "int8":
        sources = (Int8Source(src) for src in sources)
    elif quantization == "bf16":
        sources = (Bf16Source(src) for src in sources)
    return sources, count_tensors(ckpt.path)


def load_weights(model: nn.Module, sources: Iterable[TensorSource], total: int | None = None,
                 progress: bool = True, desc: str = "Loading weights") -> None:
    """Stream `sources` into `model`; raise naming every missing or unexpected tensor."""
    params = dict(model.named_parameters(remove_duplicate=True))
    loaded: dict[str, set] = {name: set() for name in params}
    unexpected: list[str] = []
    for whole in tqdm(sources, total=total, desc=desc, disable=not progress, unit="tensor"):
        for src in model.checkpoint_pieces(whole):
            target = model.weight_target(src.name)
            if target is None:
                continue
            pname, shard_id = target
            param = params.get(pname)
            if param is None:
                unexpected.append(src.name)
                continue
            param.weight_loader(param, src, shard_id)
            loaded[pname].add(shard_id)
        whole.release()  # a GGUF tensor's expanded or raw copy: the layers copied or keep what they need
    missing = [
        f"{name}[{shard}]" if shard is not None else name
        for name, p in params.items()
        for shard in sorted(p.expected_shards - loaded[name], key=str)
    ]
    if missing or unexpected:
        raise ValueError(
            "checkpoint does not match the model: "
            + (f"missing {len(missing)}: {', '.join(missing[:10])}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected {len(unexpected)}: {', '.join(unexpected[:10])}" if unexpected else "")
        )
    for module in model.modules():
        hook = getattr(module, "process_after_loading", None)
        if hook is not None:
            hook()
