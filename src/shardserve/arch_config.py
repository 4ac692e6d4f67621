"""Each architecture family's reading of config.json beyond the keys every model shares, for
model_config.py: which layers keep a sliding window, the MLP's activation, DeepSeek's latent
attention and gate, Gemma's caps, local RoPE base and text_config; the defaults transformers'
config classes assume; and every option the engine does not implement, refused by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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


# What transformers' SiglipVisionConfig assumes for a key a config.json's vision_config leaves out.
SIGLIP_DEFAULTS: dict[str, Any] = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                       num_attention_heads=12, num_channels=3, image_size=224, patch_size=16,
                                       hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
GEMMA3_IMAGE_MEAN = GEMMA3_IMAGE_STD = (0.5, 0.5, 0.5)  # Gemma 3's preprocessor_config.json


def _square(value: Any, what: str) -> int:
    """An int, or a [h, w] pair of equal sides (SiglipVisionConfig takes both)."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"vision_config.{what} {value} is not square; only square images are supported")
        value = value[0]
    return int(value)


@dataclass(frozen=True)
class VisionConfig:
    """Gemma 3's image side: a SigLIP tower over `image_size` pixels square in `patch_size`
    patches, pooled to `mm_tokens_per_image` tokens projected to the text width; a prompt holds
    each image as that many `image_token_id` placeholders between `boi_token_id` and
    `eoi_token_id`. Pixels are normalized by `image_mean` / `image_std` after scaling to [0, 1]."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    num_channels: int
    mm_tokens_per_image: int
    text_hidden_size: int
    image_token_id: int = 262144
    boi_token_id: int = 255999
    eoi_token_id: int = 256000
    image_mean: tuple[float, float, float] = GEMMA3_IMAGE_MEAN
    image_std: tuple[float, float, float] = GEMMA3_IMAGE_STD

    def __post_init__(self) -> None:
        side = self.tokens_per_side
        if side == 0 or side * side != self.mm_tokens_per_image or self.patches_per_side % side:
            raise ValueError(f"mm_tokens_per_image {self.mm_tokens_per_image} does not pool a "
                             f"{self.patches_per_side}x{self.patches_per_side} grid of patches into a square")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not a multiple of {self.num_heads} heads")

    @classmethod
    def from_hf(cls, config: dict[str, Any], preprocessor: dict[str, Any] | None = None) -> VisionConfig:
        """From a Gemma3ForConditionalGeneration config.json (and its preprocessor_config.json, for
        the normalization), with transformers' defaults for the keys left out."""
        v = SIGLIP_DEFAULTS | (config.get("vision_config") or {})
        if v["hidden_act"] != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported model option: vision_config.hidden_act {v['hidden_act']!r} (SigLIP's "
                             "is 'gelu_pytorch_tanh')")
        text = config.get("text_config") or {}
        pre = preprocessor or {}
        return cls(hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
                   num_layers=int(v["num_hidden_layers"]), num_heads=int(v["num_attention_heads"]),
                   image_size=_square(v["image_size"], "image_size"), patch_size=_square(v["patch_size"], "patch_size"),
                   layer_norm_eps=float(v["layer_norm_eps"]), num_channels=int(v["num_channels"]),
                   mm_tokens_per_image=int(config.get("mm_tokens_per_image") or 256),
                   text_hidden_size=int(text.get("hidden_size") or HF_DEFAULTS["gemma3_text"]["hidden_size"]),
                   image_token_id=int(config.get("image_token_index", config.get("image_token_id", 262144))),
                   boi_token_id=int(config.get("boi_token_index", 255999)),
                   eoi_token_id=int(config.get("eoi_token_index", 256000)),
                   image_mean=tuple(float(x) for x in pre.get("image_mean", GEMMA3_IMAGE_MEAN)),
                   image_std=tuple(float(x) for x in pre.get("image_std", GEMMA3_IMAGE_STD)))

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return int(self.mm_tokens_per_image**0.5)

    @property
    def tokens_per_image(self) -> int:
        """The text model's rows one image becomes (the projector's pooled grid)."""
        return self.tokens_per_side**2


def vision_config(d: dict[str, Any]) -> VisionConfig | None:
    """A Gemma 3 vision-language config's image side; None for any other config."""
    return VisionConfig.from_hf(d) if d.get("model_type") == "gemma3" else None


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


def sliding_layers(d: dict[str, Any]) -> list[bool]:
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


def activation(d: dict[str, Any]) -> str:
    """The MLP's activation: Gemma names it `hidden_activation`, the others `hidden_act`."""
    key = "hidden_activation" if d.get("hidden_activation") else "hidden_act"
    act = d.get(key) or "silu"
    if act not in ACTIVATIONS and act != "gelu_new":  # gelu_new: the same tanh approximation
        raise ValueError(f"unsupported model option: {key} {act!r} in config.json (this engine implements "
                         f"{', '.join(map(repr, ACTIVATIONS))})")
    return "gelu_pytorch_tanh" if act == "gelu_new" else act


def gemma3_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's text model: the local RoPE base of its windowed layers (transformers 5 writes
    both bases per layer type under rope_parameters; the Hub's configs write rope_local_base_freq)."""
    rope = d.get("rope_parameters") or {}
    local = rope.get("sliding_attention") or {}
    if (local.get("rope_type") or "default") != "default":
        raise ValueError(f"unsupported model option: rope_type {local['rope_type']!r} on Gemma 3's sliding layers")
    theta = local.get("rope_theta", d.get("rope_local_base_freq", 10000.0))
    return dict(window_rope_theta=float(theta))


def text_model(d: dict[str, Any]) -> dict[str, Any]:
    """A vision-language checkpoint's text model, which is what is served: Gemma 3's 4B-27B
    (model_type gemma3) keep it under `text_config`, stating only what differs from
    Gemma3TextConfig's defaults; the token ids and dtype may sit at the top."""
    if d.get("model_type") != "gemma3" or not isinstance(d.get("text_config"), dict):
        return d
    text = d["text_config"] | {"architectures": d["architectures"], "model_type": "gemma3_text"}
    top = ("eos_token_id", "bos_token_id", "tie_word_embeddings", "torch_dtype", "dtype", "quantization_config")
    return {k: d[k] for k in top if k in d and k not in text} | text


def gemma_caps(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma's query scale and tanh caps (Gemma 2's; Gemma 3's configs leave them null)."""
    def cap(key: str) -> float | None:
        return None if d.get(key) is None else float(d[key])

    return dict(query_pre_attn_scalar=float(d["query_pre_attn_scalar"]),  # HF_DEFAULTS' 256 where left out
                attn_logit_softcap=cap("attn_logit_softcapping"), final_logit_softcap=cap("final_logit_softcapping"))


def sliding_window_of(d: dict[str, Any]) -> int | None:
    """Qwen2-style configs carry a window they do not use (`use_sliding_window: false`)."""
    window = d.get("sliding_window")
    return int(window) if window and d.get("use_sliding_window", True) else None


# What transformers' config classes assume for a key a config.json leaves out, where it changes
# the arithmetic (a trimmed DeepSeek config must route as transformers would, not as 1 group).
HF_DEFAULTS: dict[str, dict[str, Any]] = {
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
IMPLEMENTED: dict[str, list[tuple[str, tuple]]] = {
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


def refuse_unimplemented(d: dict[str, Any]) -> None:
    for key, allowed in IMPLEMENTED[""] + IMPLEMENTED.get(d.get("model_type", ""), []):
        value = d.get(key)
        if value not in allowed:
            shown = value.get("quant_method", value) if isinstance(value, dict) else value
            raise ValueError(f"unsupported model option: {key} {shown!r} in config.json "
                             f"(this engine implements {', '.join(repr(a) for a in allowed if a is not None)})"
                             if any(a is not None for a in allowed) else
                             f"unsupported model option: {key} {shown!r} in config.json (not implemented)")


def deepseek_fields(d: dict[str, Any], model_type: str) -> dict[str, Any]:
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
