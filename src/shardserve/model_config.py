"""The model's shape, normalised from config.json (or a GGUF's metadata) into one frozen object.

Every architecture's reading of config.json is here, and so is every refusal of an option the
engine does not implement: named by its field and value, at start, never a silent wrong answer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

from shardserve.rope_config import RopeScaling, rope_scaling, rotary_dim


def eos_token_ids(value: Any) -> tuple[int, ...]:
    """An `eos_token_id` field (config.json's or generation_config.json's: one id, a list of
    them, or absent) as a tuple of ids."""
    return tuple(value) if isinstance(value, list) else (() if value is None else (int(value),))


@dataclass(frozen=True)
class LatentAttentionConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): q through a `q_lora_rank` bottleneck (None:
    one plain projection), K and V decompressed from a `kv_lora_rank` latent, and a decoupled
    `qk_rope_head_dim` rotary part shared by every head."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rotary pairs are (x0, x1), (x2, x3) .. as DeepSeek lays them out


@dataclass(frozen=True)
class RouterConfig:
    """How an MoE gate picks each token's experts. `scoring`: softmax or sigmoid over the logits;
    `groups`: "none", "max" (DeepSeek-V2's group-limited greedy: the `topk_group` groups of the
    highest score) or "top2" (V3: groups ranked by their two best biased scores); `renormalize`:
    the chosen weights divided by their sum; `scaling`: a factor on them after."""

    scoring: str = "softmax"
    groups: str = "none"
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = False
    scaling: float = 1.0
    correction_bias: bool = False  # V3's e_score_correction_bias, added for choosing only
    float32: bool = False  # the gate's weight and logits in float32 whatever the dtype (DeepSeek's)


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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dictionary (v4 or v5 key spellings)."""
        archs = d.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        d = _text_model(d)
        d = _HF_DEFAULTS.get(d.get("model_type", ""), {}) | d
        _refuse_unimplemented(d)
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        model_type = d.get("model_type", "")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "full_attention" in rope:  # one per layer type (Gemma 3): the windowed layers' in _gemma3
            rope = rope["full_attention"] or {}
        theta = d.get("rope_theta", rope.get("rope_theta", 1e6 if model_type == "gemma3_text" else 10000.0))
        head_dim = int(d.get("head_dim") or hidden // heads)
        # (rope_parameters' value first, as transformers' Phi3Config reads it)
        partial = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
        windowed = _sliding_layers(d)
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
            sliding_window=_sliding_window(d) if any(windowed) else None,
            full_layers=tuple(i for i, w in enumerate(windowed) if not w) if any(windowed) else (),
            mlp_activation=_activation(d),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            partial_rotary_dim=rotary_dim(head_dim, partial, d.get("rotary_dim")),
        )
        if model_type == "mixtral":  # experts as wide as the dense MLP, top-k renormalised
            fields.update(moe_intermediate_size=fields["intermediate_size"], router=RouterConfig(renormalize=True))
        if model_type in ("deepseek_v2", "deepseek_v3"):
            fields.update(_deepseek(d, model_type))
        if model_type == "gemma3_text":
            fields.update(_gemma3(d))
        if model_type in ("gemma2", "gemma3_text"):
            fields.update(_gemma_caps(d))
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
        """This config as served with contexts of up to `max_model_len` tokens: LongRoPE's long
        factors where that exceeds the pretraining length, else its short ones, for every request
        alike (vLLM's rule; transformers picks by each call's longest position, which agrees for
        prompts past that length and for contexts within it)."""
        s = self.rope_scaling
        if s is None or s.kind != "longrope":
            return self
        return replace(self, rope_scaling=replace(s, use_long=max_model_len > s.original_max_position_embeddings))

    def kv_values_per_token(self, num_kv_heads: int, num_layers: int) -> int:
        """Cached values (K and V) one token costs a rank holding `num_kv_heads` over `num_layers`."""
        return num_layers * num_kv_heads * sum(self.kv_widths)


def _sliding_layers(d: dict[str, Any]) -> list[bool]:
    """Which layers keep the window, as transformers decides: config.json's `layer_types`, or where
    it is left out, as each config class fills it in (Qwen2 and Qwen3 from `max_window_layers` on,
    Qwen2-MoE its even layers below it); Mistral's modeling windows every layer whatever it says."""
    n, model_type = int(d["num_hidden_layers"]), d.get("model_type", "")
    types = d.get("layer_types")
    if types and model_type != "mistral":
        return [t == "sliding_attention" for t in types]
    first = int(d.get("max_window_layers", 28))
    if model_type in ("gemma2", "gemma3_text"):  # every `sliding_window_pattern`-th layer attends fully
        pattern = int(d.get("sliding_window_pattern", 2 if model_type == "gemma2" else 6))
        if pattern < 1:
            raise ValueError(f"unsupported model option: sliding_window_pattern {pattern} in config.json (>= 1)")
        return [(i + 1) % pattern != 0 for i in range(n)]
    if model_type in ("qwen2", "qwen3"):
        return [i >= first for i in range(n)]
    if model_type == "qwen2_moe":
        return [i % 2 == 0 and i < first for i in range(n)]
    return [True] * n


ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _activation(d: dict[str, Any]) -> str:
    """The MLP's activation: Gemma names it `hidden_activation`, the others `hidden_act`."""
    key = "hidden_activation" if d.get("hidden_activation") else "hidden_act"
    act = d.get(key) or "silu"
    if act not in ACTIVATIONS and act != "gelu_new":  # gelu_new: the same tanh approximation
        raise ValueError(f"unsupported model option: {key} {act!r} in config.json (this engine implements "
                         f"{', '.join(map(repr, ACTIVATIONS))})")
    return "gelu_pytorch_tanh" if act == "gelu_new" else act


def _gemma3(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's text model: the local RoPE base of its windowed layers (transformers 5 writes
    both bases per layer type under rope_parameters; the Hub's configs write rope_local_base_freq)."""
    rope = d.get("rope_parameters") or {}
    local = rope.get("sliding_attention") or {}
    if (local.get("rope_type") or "default") != "default":
        raise ValueError(f"unsupported model option: rope_type {local['rope_type']!r} on Gemma 3's sliding layers")
    theta = local.get("rope_theta", d.get("rope_local_base_freq", 10000.0))
    return dict(window_rope_theta=float(theta))


def _text_model(d: dict[str, Any]) -> dict[str, Any]:
    """A vision-language checkpoint's text model, which is what is served: Gemma 3's 4B-27B
    (model_type gemma3) keep it under `text_config`, stating only what differs from
    Gemma3TextConfig's defaults; the token ids and dtype may sit at the top."""
    if d.get("model_type") != "gemma3" or not isinstance(d.get("text_config"), dict):
        return d
    text = d["text_config"] | {"architectures": d["architectures"], "model_type": "gemma3_text"}
    top = ("eos_token_id", "bos_token_id", "tie_word_embeddings", "torch_dtype", "dtype", "quantization_config")
    return {k: d[k] for k in top if k in d and k not in text} | text


def _gemma_caps(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma's query scale and tanh caps (Gemma 2's; Gemma 3's configs leave them null)."""
    def cap(key: str) -> float | None:
        return None if d.get(key) is None else float(d[key])

    return dict(query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
                attn_logit_softcap=cap("attn_logit_softcapping"), final_logit_softcap=cap("final_logit_softcapping"))


def _sliding_window(d: dict[str, Any]) -> int | None:
    """Qwen2-style configs carry a window they do not use (`use_sliding_window: false`)."""
    window = d.get("sliding_window")
    return int(window) if window and d.get("use_sliding_window", True) else None


# What transformers' config classes assume for a key a config.json leaves out, where it changes
# the arithmetic (a trimmed DeepSeek config must route as transformers would, not as 1 group).
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(first_k_dense_replace=0, q_lora_rank=1536, n_shared_experts=2, routed_scaling_factor=1.0,
                        topk_method="greedy", norm_topk_prob=False, n_routed_experts=64),
    "gemma3_text": dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                        sliding_window=4096, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                        max_position_embeddings=131_072, rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1),
    "gemma2": dict(vocab_size=256_000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                   sliding_window=4096, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                   max_position_embeddings=8192, rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "deepseek_v3": dict(first_k_dense_replace=3, q_lora_rank=1536, n_shared_experts=1, routed_scaling_factor=2.5,
                        n_group=8, topk_group=4, norm_topk_prob=True, n_routed_experts=256),
}

# (field, the values the engine implements) for every model type; checked before anything else.
_IMPLEMENTED: dict[str, list[tuple[str, tuple]]] = {
    "": [("quantization_config", (None,))],
    "gemma2": [("use_bidirectional_attention", (None, False))],
    "gemma3_text": [("use_bidirectional_attention", (None, False))],
    # transformers' V2 never renormalises and always rotates interleaved pairs, DeepSeek's own code
    # would do as these say: two readings of one checkpoint, so neither is guessed.
    "deepseek_v2": [("topk_method", (None, "greedy", "group_limited_greedy")), ("scoring_func", (None, "softmax")),
                    ("moe_layer_freq", (None, 1)), ("norm_topk_prob", (None, False)),
                    ("rope_interleave", (None, True))],
    "deepseek_v3": [("topk_method", (None, "noaux_tc")), ("scoring_func", (None, "sigmoid")),
                    ("moe_layer_freq", (None, 1))],
}


def _refuse_unimplemented(d: dict[str, Any]) -> None:
    for key, allowed in _IMPLEMENTED[""] + _IMPLEMENTED.get(d.get("model_type", ""), []):
        value = d.get(key)
        if value not in allowed:
            shown = value.get("quant_method", value) if isinstance(value, dict) else value
            raise ValueError(f"unsupported model option: {key} {shown!r} in config.json "
                             f"(this engine implements {', '.join(repr(a) for a in allowed if a is not None)})"
                             if any(a is not None for a in allowed) else
                             f"unsupported model option: {key} {shown!r} in config.json (not implemented)")


def _deepseek(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """DeepSeek-V2/V3: latent attention, and DeepSeekMoE (shared experts beside fine-grained
    routed ones, the first `first_k_dense_replace` layers dense)."""
    experts, groups = int(d.get("n_routed_experts") or 0), int(d.get("n_group") or 1)
    if experts and experts % groups:
        raise ValueError(f"unsupported model option: n_group {groups} does not divide n_routed_experts {experts}")
    v3 = model_type == "deepseek_v3"
    if v3:
        router = RouterConfig("sigmoid", "top2", groups, int(d.get("topk_group") or 1),
                              bool(d.get("norm_topk_prob", True)), float(d.get("routed_scaling_factor", 1.0)), True,
                              float32=True)
    else:  # (norm_topk_prob is refused above: transformers' V2 ignores it)
        grouped = d.get("topk_method") == "group_limited_greedy"
        router = RouterConfig("softmax", "max" if grouped else "none", groups, int(d.get("topk_group") or 1),
                              False, float(d.get("routed_scaling_factor", 1.0)), float32=True)
    q_lora = d.get("q_lora_rank")
    mla = LatentAttentionConfig(int(q_lora) if q_lora else None, int(d["kv_lora_rank"]), int(d["qk_nope_head_dim"]),
                                int(d["qk_rope_head_dim"]), int(d["v_head_dim"]),
                                bool(d.get("rope_interleave", True)))
    moe_inter = int(d.get("moe_intermediate_size") or 0)
    return dict(num_kv_heads=1, head_dim=mla.qk_rope_head_dim, mla=mla, num_experts=experts,
                shared_expert_intermediate_size=int(d.get("n_shared_experts") or 0) * moe_inter,
                shared_expert_gated=False, router=router,
                mlp_only_layers=tuple(range(int(d.get("first_k_dense_replace") or 0))))
