"""The model's own sampling defaults, as vLLM's `--generation-config auto` reads them, and the
ids that end its generations.

A Hugging Face checkpoint may ship generation_config.json; a GGUF may carry llama.cpp's
`general.sampling.*` keys. Only fields a request can also set are taken, under SamplingParams'
names; a request's own value always wins over them.
"""

from __future__ import annotations

import json
import os
from typing import Any

from shardserve.config import ModelConfig, eos_token_ids
from shardserve.loader.model_path import Checkpoint

# generation_config.json name -> SamplingParams name
HF_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty"}
# GGUF general.sampling.* name -> SamplingParams name
GGUF_FIELDS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
               "penalty_repeat": "repetition_penalty"}


def generation_defaults(ckpt: Checkpoint, source: str = "auto") -> tuple[dict[str, Any], str]:
    """(defaults, where they came from). `source`: 'auto' (the checkpoint's own), 'none', or a
    directory holding a generation_config.json."""
    if source == "none":
        return {}, "built-in: --generation-config none"
    if source != "auto":
        path = os.path.join(source, "generation_config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--generation-config {source!r}: no generation_config.json there")
        found, where = _from_json(path), path
    elif ckpt.is_gguf:
        from shardserve.loader.gguf_metadata import read_gguf_sampling

        raw = read_gguf_sampling(ckpt.path)
        found = _typed({GGUF_FIELDS[k]: v for k, v in raw.items() if k in GGUF_FIELDS})
        where = ckpt.name
    else:
        path = os.path.join(ckpt.path, "generation_config.json")
        if not os.path.isfile(path):
            return {}, "built-in: the model ships no generation_config.json"
        found, where = _from_json(path), "generation_config.json"
    return found, (f"from {where}" if found else f"built-in: {where} sets none")


def _from_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        raw = json.load(f)
    return _typed({HF_FIELDS[k]: v for k, v in raw.items() if k in HF_FIELDS and v is not None})


def _typed(values: dict[str, Any]) -> dict[str, Any]:
    # top_k 0 means "off" in Hugging Face and llama.cpp alike; SamplingParams spells it -1.
    out = {k: (int(v) if k == "top_k" else float(v)) for k, v in values.items()}
    if out.get("top_k") == 0:
        out["top_k"] = -1
    return out


def eos_ids(ckpt: Checkpoint, model_cfg: ModelConfig, tokenizer=None) -> tuple[int, ...]:
    """Every id that ends a generation, sorted: config.json's, a Hugging Face checkpoint's
    generation_config.json's (an instruct model's end-of-turn token is often only there) and the
    tokenizer's own."""
    ids = set(model_cfg.eos_token_ids) | set(_generation_eos(ckpt))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def _generation_eos(ckpt: Checkpoint) -> tuple[int, ...]:
    path = os.path.join(ckpt.path, "generation_config.json")
    if ckpt.is_gguf or not os.path.exists(path):
        return ()
    with open(path) as f:
        return eos_token_ids(json.load(f).get("eos_token_id"))


def describe(defaults: dict[str, Any], origin: str) -> str:
    """One line for the start-up log: which defaults a request that leaves them out gets."""
    from shardserve.sampling_params import SamplingParams

    base = SamplingParams()
    shown = {k: defaults.get(k, getattr(base, k)) for k in ("temperature", "top_p", "top_k", "min_p",
                                                             "repetition_penalty")}
    text = " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
    return f"sampling defaults: {text} ({origin})"
