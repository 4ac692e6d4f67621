"""Speculative decoding's flags, checked before the target loads (one line naming the flag)."""

from __future__ import annotations

import os
from dataclasses import replace

from shardserve.config import EngineConfig
from shardserve.distributed.layout import Layout, LayoutError
from shardserve.launch.devices import kv_value_bytes
from shardserve.loader.model_path import Checkpoint, resolve_checkpoint
from shardserve.loader.weights import read_model_config


def check_speculative(cfg: EngineConfig, layout: Layout, ckpt: Checkpoint) -> None:
    spec = cfg.speculative_config
    if spec is None:
        return
    if layout.pp > 1:
        # The next step's proposals come from this step's result, and a pipeline plans micro-batch
        # i+1 before micro-batch i has one (docs/speculative.md says more).
        raise LayoutError(f"--speculative-method {spec.method} needs --pp-size 1 (got {layout.pp}): each step's "
                          f"proposals follow from the step before's result, which a pipeline has not produced yet "
                          f"when it plans the next micro-batch (vLLM and SGLang refuse it too)")
    if spec.method != "draft":
        return
    if spec.draft_tp == "same" and (layout.cp > 1 or layout.dp_attention):
        raise LayoutError("--speculative-draft-tp same shards the draft over a tensor group; with --cp-size or "
                          "--enable-dp-attention use --speculative-draft-tp 1 (the draft whole on each leader)")
    try:
        draft = resolve_checkpoint(spec.model)
    except FileNotFoundError as e:
        raise LayoutError(f"--speculative-model: {str(e).replace('--model ', '')}") from None
    target_cfg, draft_cfg = read_model_config(ckpt), read_model_config(draft)
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise LayoutError(f"--speculative-model {draft.name}: its vocabulary has {draft_cfg.vocab_size} tokens, the "
                          f"target's {target_cfg.vocab_size}; a draft must share the target's tokenizer")
    draft_limit, longest = draft_cfg.max_position_embeddings, target_cfg.served_length(cfg.max_model_len)
    if draft_limit < longest:
        raise LayoutError(f"--speculative-model {draft.name}: it takes {draft_limit} positions, sequences "
                          f"here may reach {longest}; give --max-model-len {draft_limit} or less, or a draft of the "
                          f"target's context length")
    if spec.draft_tp == "same":
        try:
            layout.check_model(draft_cfg.num_layers, draft_cfg.num_heads, draft_cfg.num_experts)
        except LayoutError as e:
            raise LayoutError(f"--speculative-draft-tp same: the draft {draft.name}: {e}") from None
    check_same_tokenizer(ckpt, draft)
    check_draft_fits(cfg, ckpt, draft, target_cfg, draft_cfg)


def check_same_tokenizer(target: Checkpoint, draft: Checkpoint) -> None:
    """Same vocabulary size is not enough: the ids must mean the same tokens."""
    from shardserve.loader.tokenizer import load_tokenizer

    a, b = load_tokenizer(target), load_tokenizer(draft)
    if a is None or b is None:
        return  # token-id prompts only: the sizes matched, nothing more to compare
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        differ = sorted(set(va.items()) ^ set(vb.items()), key=lambda kv: kv[1])[:3]
        raise LayoutError(f"--speculative-model {draft.name}: its tokenizer differs from the target's "
                          f"({len(set(va.items()) ^ set(vb.items()))} (token, id) pairs differ, e.g. {differ})")


def checkpoint_bytes(ckpt: Checkpoint) -> int:
    if ckpt.is_gguf:
        return os.path.getsize(ckpt.path)
    return sum(os.path.getsize(os.path.join(ckpt.path, f)) for f in os.listdir(ckpt.path)
               if f.endswith((".safetensors", ".bin")))


def check_draft_fits(cfg: EngineConfig, target: Checkpoint, draft: Checkpoint, target_cfg, draft_cfg) -> None:
    """The draft's weights and KV pool next to the target's must fit in this machine's available
    memory. The draft's pool holds as many tokens as the target's, so it is the target's KV budget
    scaled by the two models' bytes per token. (Host memory: on CUDA the device's memory decides,
    which this does not check.)"""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return
    per_token = {m: c.kv_values_per_token(c.num_kv_heads, c.num_layers)
                 for m, c in (("t", target_cfg), ("d", draft_cfg))}
    kv = cfg.kv_cache_memory if cfg.kv_cache_memory > 1 else cfg.kv_cache_memory * avail
    if cfg.num_pages is not None:
        kv = cfg.num_pages * cfg.page_size * per_token["t"] * kv_value_bytes(cfg)
    # As many tokens as the target's pool, each value in the draft's own cache dtype (it keeps
    # --kv-cache-dtype auto: engine/draft_proposer), whatever the target's.
    draft_kv = (kv * per_token["d"] / per_token["t"]
                * kv_value_bytes(replace(cfg, kv_cache_dtype="auto")) / kv_value_bytes(cfg))
    draft_bytes = checkpoint_bytes(draft)
    need = checkpoint_bytes(target) + draft_bytes + kv + draft_kv
    if need > avail:
        raise LayoutError(f"--speculative-model {draft.name}: its weights ({draft_bytes / 2**30:.1f} GiB) "
                          f"and KV pool ({draft_kv / 2**30:.1f} GiB) beside the target's need {need / 2**30:.1f} GiB, "
                          f"{avail / 2**30:.1f} GiB is available (a smaller --kv-cache-memory shrinks both pools)")
