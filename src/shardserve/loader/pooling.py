"""How a decoder model serves embeddings: which hidden states it pools, whether it normalizes, and
which truncated widths it was trained for.

From `--pooling {last,mean}` if given, else the checkpoint's sentence-transformers config where
it has one (modules.json: a Pooling module's `pooling_mode_lasttoken` / `pooling_mode_mean_tokens`,
a Normalize module), else vLLM's default for a causal LM: the last token, normalized. Matryoshka
widths (`dimensions` on a request) come from config.json's `matryoshka_dimensions`, or any width
where it says `is_matryoshka` (Qwen3-Embedding is trained so).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from shardserve.loader.model_path import Checkpoint

MODES = ("last", "mean")
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
             "pooling_mode_max_tokens": "max", "pooling_mode_weightedmean_tokens": "weightedmean"}


@dataclass(frozen=True)
class Pooling:
    mode: str | None  # "last" or "mean"; None: this checkpoint's pooling is not one served here
    normalize: bool = True
    dimensions: tuple[int, ...] | None = None  # widths a request may truncate to; () any; None none
    origin: str = "default"
    why_not: str = ""  # with mode None: what the checkpoint asks for

    def finish(self, pooled: list[float], dimensions: int | None = None) -> list[float]:
        """The embedding a request gets: truncated to `dimensions` (Matryoshka), then normalized."""
        vec = pooled[:dimensions] if dimensions is not None else pooled
        if not self.normalize:
            return vec
        norm = math.sqrt(sum(x * x for x in vec)) or 1.0
        return [x / norm for x in vec]

    def check_dimensions(self, dimensions: int, width: int) -> str | None:
        """Why `dimensions` cannot be served, or None."""
        if self.dimensions is None:
            return "this model is not trained for truncated embeddings (no matryoshka_dimensions in its config)"
        if not 1 <= dimensions <= width or (self.dimensions and dimensions not in self.dimensions):
            allowed = ", ".join(map(str, self.dimensions)) if self.dimensions else f"1 to {width}"
            return f"dimensions {dimensions} is not one this model serves ({allowed})"
        return None


def pooling_of(ckpt: Checkpoint, flag: str | None = None) -> Pooling:
    root = ckpt.path if not ckpt.is_gguf else None
    dims = _matryoshka(root)
    st = _sentence_transformers(root)
    if flag is not None:
        normalize = st[1] if st is not None else True
        return Pooling(flag, normalize, dims, f"--pooling {flag}")
    if st is not None:
        mode, normalize = st
        if mode not in MODES:
            return Pooling(None, normalize, dims, "sentence-transformers config",
                           f"its sentence-transformers config pools by {mode!r}; start with --pooling last or mean")
        return Pooling(mode, normalize, dims, "sentence-transformers config")
    return Pooling("last", True, dims)


def _sentence_transformers(root: str | None) -> tuple[str, bool] | None:
    """(pooling mode, normalized) from modules.json, or None where there is none."""
    path = os.path.join(root, "modules.json") if root else ""
    if not path or not os.path.isfile(path):
        return None
    with open(path) as f:
        modules = json.load(f)
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules if isinstance(m, dict)}
    mode = "mean"  # sentence-transformers' own default
    if "Pooling" in kinds:
        cfg_path = os.path.join(root, kinds["Pooling"], "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        mode = next((m for key, m in _ST_MODES.items() if cfg.get(key)), mode)
    return mode, "Normalize" in kinds


def _matryoshka(root: str | None) -> tuple[int, ...] | None:
    path = os.path.join(root, "config.json") if root else ""
    if not path or not os.path.isfile(path):
        return None
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("matryoshka_dimensions"):
        return tuple(int(d) for d in cfg["matryoshka_dimensions"])
    return () if cfg.get("is_matryoshka") else None
