"""The model's shape, normalised from config.json (or a GGUF's metadata) into one frozen object.

Every architecture's reading of config.json is here or in arch_config.py (what one family reads
beyond the shared keys), and so is every refusal of an option the engine does not implement:
named by its field and value, at start, never a silent wrong answer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

from shardserve.arch_config import (
    HF_DEFAULTS,
    LatentAttentionConfig,
    RouterConfig,
    VisionConfig,
    activation,
    deepseek_fields,
    gemma3_fields,
    gemma_caps,
    refuse_unimplemented,
    sliding_layers,
    sliding_window_of,
    text_model,
    vision_config,
)
from shardserve.rope_config import RopeScaling, rope_scaling, rotary_dim


def eos_token_ids(value: Any) -> tuple[int, ...]:
    """An `eos_token_id` field (config.json's or generation_config.json's: one id, a list of
    them, or absent) as a tuple of ids."""
    return tuple(value) if isinstance(value, list) else (() if value is None else (int(value),))


@dataclass(frozen=True)
class ModelConfig:
    """The architecture-level facts the engine needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # 1 under latent attention: the latent is one cache "head" every query reads
    head_dim: int  # the rotary dimension under latent attention
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Mixture of experts (0 experts means a dense model).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True  # Qwen2-MoE's sigmoid gate on it; DeepSeek's is plain
    router: RouterConfig = field(default_factory=RouterConfig)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    mla: LatentAttentionConfig | None = None
    # Sliding-window attention: each token attends to the last `sliding_window` keys (itself
    # included), on every layer but `full_layers` (None where no layer keeps one): Mistral and Phi-3
    # window every layer, Gemma 3 five in six, Qwen2's max_window_layers those from it on.
    sliding_window: int | None = None
    full_layers: tuple[int, ...] = ()
    # The windowed layers' RoPE base where it is not `rope_theta` (Gemma 3's local base; those
    # layers then take no rope scaling, which applies to the full-attention layers).
    window_rope_theta: float | None = None
    # The gated MLP's activation: "silu", or "gelu_pytorch_tanh" (Gemma's).
    mlp_activation: str = "silu"
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma's), else head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Gemma 2's tanh caps: every scaled attention score s becomes cap * tanh(s / cap) before the
    # softmax, and every logit likewise (None: uncapped).
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    torch_dtype: str = "float32"
    # The leading dims of each head that RoPE rotates (partial_rotary_factor x head_dim; Phi-4-mini
    # rotates 3/4); 0 means all of head_dim.
    partial_rotary_dim: int = 0
    # The positions the rotary tables cover: the served length once `serving` has set it (0: all of
    # max_position_embeddings; a 131,072-position table of 256-wide heads is 128 MiB).
    served_positions: int = 0
    # A vision-language model's image side (Gemma 3's 4B-27B), None for text-only models.
    vision: VisionConfig | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dictionary (v4 or v5 key spellings)."""
        archs = d.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        vision = vision_config(d)
        d = text_model(d)
        d = HF_DEFAULTS.get(d.get("model_type", ""), {}) | d
        refuse_unimplemented(d)
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        model_type = d.get("model_type", "")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "full_attention" in rope:  # one per layer type (Gemma 3): the windowed layers' in gemma3_fields
            rope = rope["full_attention"] or {}
        theta = d.get("rope_theta", rope.get("rope_theta", 1e6 if model_type == "gemma3_text" else 10000.0))
        head_dim = int(d.get("head_dim") or hidden // heads)
        # (rope_parameters' value first, as transformers' Phi3Config reads it)
        partial = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
        windowed = sliding_layers(d)
        fields: dict[str, Any] = dict(
            architecture=archs[0],
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d.get("intermediate_size", 0)),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type.startswith("qwen2"))),
            rope_scaling=rope_scaling(rope, d),
            eos_token_ids=eos_token_ids(d.get("eos_token_id")),
            bos_token_id=d.get("bos_token_id"),
            num_experts=int(d.get("num_experts") or d.get("num_local_experts") or 0),
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
            router=RouterConfig(renormalize=bool(d.get("norm_topk_prob", False))),
            decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            sliding_window=sliding_window_of(d) if any(windowed) else None,
            full_layers=tuple(i for i, w in enumerate(windowed) if not w) if any(windowed) else (),
            mlp_activation=activation(d),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            partial_rotary_dim=rotary_dim(head_dim, partial, d.get("rotary_dim")),
            vision=vision,
        )
        if model_type == "mixtral":  # experts as wide as the dense MLP, top-k renormalised
            fields.update(moe_intermediate_size=fields["intermediate_size"], router=RouterConfig(renormalize=True))
        if model_type in ("deepseek_v2", "deepseek_v3"):
            fields.update(deepseek_fields(d, model_type))
        if model_type == "gemma3_text":
            fields.update(gemma3_fields(d))
        if model_type in ("gemma2", "gemma3_text"):
            fields.update(gemma_caps(d))
        out = cls(**fields)
        if out.num_experts and out.mlp_activation != "silu":
            raise ValueError(f"unsupported model option: hidden_act {out.mlp_activation!r} in a mixture of experts "
                             "(its experts implement 'silu')")
        if (s := out.rope_scaling) is not None and s.kind in ("longrope", "freq_factors"):
            for name, factors in (("short_factor", s.short_factor), ("long_factor", s.long_factor)):
                if len(factors) != out.rotary_dim // 2:
                    what = f"longrope {name}" if s.kind == "longrope" else "rope_freqs (a GGUF's frequency divisors)"
                    raise ValueError(f"unsupported model option: {what} has {len(factors)} entries for a "
                                     f"rotary width of {out.rotary_dim} (needs {out.rotary_dim // 2})")
        return out

    @classmethod
    def from_dir(cls, path: str) -> ModelConfig:
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_dict(json.load(f))

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen-MoE rule: sparse every `decoder_sparse_step` layers unless listed as MLP-only."""
        if self.num_experts == 0 or layer in self.mlp_only_layers:
            return False
        return (layer + 1) % self.decoder_sparse_step == 0

    @property
    def kv_widths(self) -> tuple[int, int]:
        """Values per token per KV head in the K and in the V cache. Latent attention caches one
        vector per token, the latent and the rotary key side by side, in K, and nothing in V (its
        values are the latent: read from K)."""
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim, 0
        return self.head_dim, self.head_dim

    @property
    def attention_window(self) -> int | None:
        """The window the windowed layers' attention keeps (None: full attention everywhere), where
        it changes anything: shorter than the positions."""
        w = self.sliding_window
        return w if w is not None and w < self.max_position_embeddings else None

    def windowed(self, layer: int) -> bool:
        """Whether layer `layer` keeps the sliding window (see attention_window)."""
        return self.sliding_window is not None and layer not in self.full_layers

    @property
    def rotary_dim(self) -> int:
        return self.partial_rotary_dim or self.head_dim

    def served_length(self, asked: int | None) -> int:
        """The longest context served: --max-model-len where given (never above the model's)."""
        limit = self.max_position_embeddings
        return min(asked or limit, limit)

    def serving(self, max_model_len: int) -> ModelConfig:
        """This config as served with contexts of up to `max_model_len` tokens: rotary tables of
        that many positions, and LongRoPE's long factors where it exceeds the pretraining length,
        else its short ones, for every request alike (vLLM's rule; transformers picks by each
        call's longest position, which agrees for prompts past that length and for contexts
        within it)."""
        s = self.rope_scaling
        if s is not None and s.kind == "longrope":
            s = replace(s, use_long=max_model_len > s.original_max_position_embeddings)
        return replace(self, rope_scaling=s, served_positions=max_model_len)

    def kv_values_per_token(self, num_kv_heads: int, num_layers: int) -> int:
        """Cached values (K and V) one token costs a rank holding `num_kv_heads` over `num_layers`."""
        return num_layers * num_kv_heads * sum(self.kv_widths)
