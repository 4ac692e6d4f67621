"""GGUF's `deepseek2` architecture (DeepSeek-V2, V2-Lite, V3, R1 as llama.cpp converts them),
read back into DeepSeek's Hugging Face config keys and tensor names.

llama.cpp stores latent attention as multi-query attention over the latent (head_count_kv 1,
key_length = kv_lora_rank + rope, value_length = kv_lora_rank) with the per-head sizes under
`key_length_mla` / `value_length_mla` (older files: the per-head sizes in key_length and
value_length), and kv_b_proj split into `attn_k_b` (transposed: [heads, kv_lora_rank, nope]) and
`attn_v_b` ([heads, v, kv_lora_rank]); older files keep `attn_kv_b` whole. The gate's scoring is
`expert_gating_func` (2: sigmoid, DeepSeek-V3's; else softmax, V2's). Its rotary weights are not
permuted (the graph rotates interleaved pairs, as DeepSeek's own code does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the tokenizer processes read GGUF metadata through this file, without torch
    import torch

SIGMOID = 2  # gguf.ExpertGatingFuncType.SIGMOID

# Per-layer tensor stems of deepseek2 that other architectures lack -> HF module path (its
# experts, gate and shared experts have the names the qwen MoE files use).
DEEPSEEK2_LAYER_TENSORS: dict[str, str] = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
}
CORRECTION_BIAS = "exp_probs_b"  # blk.N.exp_probs_b.bias -> mlp.gate.e_score_correction_bias
SPLIT_KV_B = ("attn_k_b", "attn_v_b")


def deepseek2_config(value: Callable[[str], Any]) -> dict[str, Any]:
    """The config.json keys of a deepseek2 file; `value(suffix)` reads `deepseek2.<suffix>`."""
    rope = int(value("rope.dimension_count"))
    if value("attention.key_length_mla") is not None:
        qk, v = int(value("attention.key_length_mla")), int(value("attention.value_length_mla"))
    else:
        qk, v = int(value("attention.key_length")), int(value("attention.value_length"))
    sigmoid = value("expert_gating_func") == SIGMOID
    groups = int(value("expert_group_count") or 1)
    q_lora = value("attention.q_lora_rank")
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
        "q_lora_rank": int(q_lora) if q_lora else None, "kv_lora_rank": int(value("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope, "qk_nope_head_dim": qk - rope, "v_head_dim": v, "rope_interleave": True,
        "n_routed_experts": int(value("expert_count") or 0),
        "num_experts_per_tok": int(value("expert_used_count") or 0),
        "moe_intermediate_size": int(value("expert_feed_forward_length") or 0),
        "n_shared_experts": int(value("expert_shared_count") or 0),
        "first_k_dense_replace": int(value("leading_dense_block_count") or 0),
        "routed_scaling_factor": float(value("expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(value("expert_weights_norm") or False),
        "n_group": groups, "topk_group": int(value("expert_group_used_count") or 1),
    }
    if not sigmoid:
        config["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    return config


def deepseek2_rope_scaling(scaling: dict[str, Any], value: Callable[[str], Any]) -> dict[str, Any]:
    """YaRN as DeepSeek's configs spell it: llama.cpp keeps 0.1 x mscale_all_dim as the log
    multiplier (and DeepSeek's checkpoints set mscale equal to it)."""
    log_mul = value("rope.scaling.yarn_log_multiplier")
    if log_mul:
        # (stored as float32: rounded back to the config's decimal value)
        scaling["mscale"] = scaling["mscale_all_dim"] = round(float(log_mul) / 0.1, 6)
    for key in ("beta_fast", "beta_slow"):
        if (v := value(f"rope.scaling.yarn_{key}")) is not None:
            scaling[key] = float(v)
    return scaling


def merged_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj's [heads * (nope + v), kv_lora_rank] from llama.cpp's k_b [heads, lora, nope]
    and v_b [heads, v, lora]."""
    import torch

    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, v_b.shape[2]).contiguous()
