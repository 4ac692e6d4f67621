"""Rotary position embedding as config.json (or a GGUF) describes it: its scaling, read into one
frozen object, and the share of each head it rotates. The arithmetic is layers/rotary.py's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling of RoPE: `linear` (every frequency divided by `factor`), `llama3` (low/high
    frequency factors), `yarn` (the beta ramp, and mscale as DeepSeek's checkpoints set it),
    `longrope` (Phi-3's per-frequency divisors, a short set for contexts within the pretraining
    length and a long set beyond it: `use_long` says which, ModelConfig.serving decides) or
    `freq_factors` (one set of such divisors, as a GGUF's rope_freqs tensor gives llama 3.x's
    scaling). `None` on ModelConfig means plain RoPE."""

    kind: str
    factor: float
    original_max_position_embeddings: int
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    use_long: bool = False

    @property
    def cos_sin_scale(self) -> float:
        """yarn's and longrope's factor on cos and sin (their "attention factor"); 1 for llama3."""
        if self.kind in ("longrope", "freq_factors"):
            if self.attention_factor is not None:
                return self.attention_factor
            f, n = self.factor, self.original_max_position_embeddings
            return 1.0 if f <= 1 else math.sqrt(1 + math.log(f) / math.log(n))
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """DeepSeek's extra factor on the attention scale: mscale(factor, mscale_all_dim) squared."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


def rotary_dim(head_dim: int, factor: float, width: int | None = None) -> int:
    """The rotated width as transformers computes it (int(head_dim x factor)), or `width` where a
    GGUF states it (rope.dimension_count), 0 meaning all of head_dim."""
    if width is not None:
        factor = int(width) / head_dim
        if int(width) % 2 or not 0 < int(width) <= head_dim:
            raise ValueError(f"unsupported model option: a rotary width of {width} for heads of {head_dim}")
        return 0 if int(width) == head_dim else int(width)
    if not 0 < factor <= 1:
        raise ValueError(f"unsupported model option: partial_rotary_factor {factor} in config.json (0 < it <= 1)")
    dim = int(head_dim * factor)
    if dim % 2:
        raise ValueError(f"unsupported model option: partial_rotary_factor {factor} rotates {dim} of {head_dim} "
                         "dims, an odd count")
    return 0 if dim == head_dim else dim


def rope_scaling(rope: dict[str, Any], d: dict[str, Any]) -> RopeScaling | None:
    kind = rope.get("rope_type") or rope.get("type")
    if kind in (None, "default"):
        return None
    if d.get("model_type") == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # Phi-3's early configs name LongRoPE so (as transformers reads them)
    if kind == "longrope":
        return _longrope(rope, d)
    if kind == "freq_factors":  # a GGUF's rope_freqs (loader/gguf_metadata.py): one set of divisors
        factors = tuple(map(float, rope["factors"]))
        return RopeScaling("freq_factors", 1.0, int(d.get("max_position_embeddings", 2048)), short_factor=factors,
                           long_factor=factors, attention_factor=1.0)
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling: rope_type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    original = int(rope.get("original_max_position_embeddings", d.get("max_position_embeddings", 8192)))
    needs = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}.get(kind, ())
    if missing := [k for k in needs if rope.get(k) is None]:
        raise ValueError(f"unsupported model option: rope_type {kind!r} without {', '.join(missing)}")
    if kind == "linear":  # positions interpolated: every frequency divided by the factor
        return RopeScaling("linear", float(rope["factor"]), original)
    if kind == "llama3":
        return RopeScaling("llama3", float(rope["factor"]), original, low_freq_factor=float(rope["low_freq_factor"]),
                           high_freq_factor=float(rope["high_freq_factor"]))
    factor = rope.get("factor") or d.get("max_position_embeddings", original) / original
    attention_factor = rope.get("attention_factor")
    return RopeScaling("yarn", float(factor), original, beta_fast=float(rope.get("beta_fast") or 32),
                       beta_slow=float(rope.get("beta_slow") or 1), mscale=float(rope.get("mscale") or 0),
                       mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
                       attention_factor=None if attention_factor is None else float(attention_factor),
                       truncate=bool(rope.get("truncate", True)))


def _longrope(rope: dict[str, Any], d: dict[str, Any]) -> RopeScaling:
    # Phi-3's pretrained length: the top-level key first, then the rope's, 4096 where both are left
    # out (as Phi3Config reads it).
    fallback = 4096 if d.get("model_type") == "phi3" else d.get("max_position_embeddings", 4096)
    original = int(d.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
                   or fallback)
    if not rope.get("short_factor") or not rope.get("long_factor"):
        raise ValueError("unsupported model option: rope_type 'longrope' without short_factor and long_factor lists")
    short, long = tuple(map(float, rope["short_factor"])), tuple(map(float, rope["long_factor"]))
    factor = rope.get("factor") or d.get("max_position_embeddings", original) / original
    attention_factor = rope.get("attention_factor")
    return RopeScaling("longrope", float(factor), original, short_factor=short, long_factor=long,
                       attention_factor=None if attention_factor is None else float(attention_factor))
