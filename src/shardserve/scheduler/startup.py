"""What a replica's leader says once its engine is built: the settings in force, in one line.

Several are decided on the rank, not by the flags: the device (cuda if present), the threads
(the launcher's share of the cores, or torch's choice), whether GGUF blocks stay quantized, the
KV pages (the budget over one page's size, the smallest over the ranks) and the context length
(the model's unless --max-model-len says less). The user sees them here, not by inference.
"""

from __future__ import annotations

import torch

from shardserve.config import ModelConfig
from shardserve.distributed.groups import ParallelGroups
from shardserve.layers import quant_kernel
from shardserve.scheduler.engine_core import EngineCore


def weights_text(quantization: str, dtype: str, is_gguf: bool) -> str:
    if quantization == "auto" and is_gguf:
        return "quantization gguf (blocks as stored)"
    if quantization == "int8":
        return "quantization int8 (Q8_0 blocks, made at load)"
    if quantization == "bf16":  # bfloat16 products' activations as the kernels say (quant_kernel.bf16_path)
        acts = "bfloat16 products' activations" if quant_kernel.bf16_activations() else "float32 activations"
        return f"quantization none (bfloat16 weights; {acts}; float32 norms and attention arithmetic)"
    return f"quantization none ({dtype} weights)"


def rank_text(groups: ParallelGroups) -> str:
    """'rank 0 of 2 (tp 0)': the rank that speaks and how many there are."""
    return groups.label.replace(f"rank {groups.rank}", f"rank {groups.rank} of {groups.layout.world}", 1)


def plural(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def startup_summary(engine: EngineCore) -> str:
    """E.g. 'rank 0 of 1: device cpu, dtype float32, quantization none (float32 weights), 1 thread
    per rank, attention cpu; KV cache float32, 256 pages x 8 tokens (2048 tokens), 1.0 MiB on this
    rank (4096 bytes a page); context length 512 tokens (the model's limit)'."""
    r, cfg, groups = engine.runner, engine.cfg, engine.runner.groups
    kv_bytes = r.pool.k.nbytes + r.pool.v.nbytes
    limit = engine.model_cfg.max_position_embeddings
    context = "the model's limit" if engine.max_model_len == limit else f"--max-model-len; the model's is {limit}"
    pages = engine.allocator.num_pages
    spread = f" over {groups.context.size} context ranks" if groups.context.size > 1 else ""
    weights = weights_text(r.quantization, cfg.dtype, engine.ckpt.is_gguf)
    return (f"{rank_text(groups)}: device {r.device}, dtype {cfg.dtype}, {weights}, "
            f"{plural(torch.get_num_threads(), 'thread')} per rank, attention {r.attention.describe()}; "
            f"KV cache {str(r.kv_dtype).removeprefix('torch.')}, {pages} pages x {cfg.page_size} tokens "
            f"({pages * cfg.page_size} tokens{spread}), "
            f"{mib(kv_bytes)} on this rank ({kv_bytes // max(1, r.num_pages)} bytes a page); "
            f"context length {engine.max_model_len} tokens ({context}){window_text(engine)}{rope_text(r.model_cfg)}"
            f"{async_text(engine)}")


def window_text(engine: EngineCore) -> str:
    """The sliding window in the summary, where the served context passes it: on which layers."""
    mc, window = engine.model_cfg, engine.runner.window
    if window is None:
        return ""
    n, full = mc.num_layers, len(mc.full_layers)
    where = f"{n - full} of {n} layers (the others attend fully)" if full else "every layer"
    return f"; sliding window of {window} tokens on {where}"


def rope_text(mc: ModelConfig) -> str:
    """LongRoPE's factor set in the summary: which one every request gets, and how to get the other."""
    s = mc.rope_scaling
    if s is None or s.kind != "longrope":
        return ""
    n = s.original_max_position_embeddings
    if s.use_long:
        return (f"; LongRoPE long factors (the context exceeds the {n} pretrained tokens; --max-model-len {n} "
                "gives the short ones, for short prompts)")
    return f"; LongRoPE short factors (the context is within the {n} pretrained tokens)"


def async_text(engine: EngineCore) -> str:
    """--async-scheduling in the summary; on the CPU, its cost (docs/architecture.md)."""
    if engine.executor is None:
        return ""
    if engine.runner.device.type == "cpu":
        return ("; async scheduling (on the CPU the executor thread and the leader share the kernels' cores: "
                "measured no faster on 2 cores, and slower for small models)")
    return "; async scheduling"


def use_threads(threads: int | None) -> None:
    """--threads for an engine in this very process (LLM with one rank): a launcher sets its
    ranks' OMP_NUM_THREADS, which reaches only the processes it starts."""
    if threads is not None:
        torch.set_num_threads(threads)
