"""How GGUF (llama.cpp) names metadata and tensors, and the Hugging Face names they map to."""

from __future__ import annotations

# general.architecture -> (HF model_type, HF architectures[0]).
GGUF_ARCH_TO_HF_MODEL: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "deepseek2": ("deepseek_v2", "DeepseekV2ForCausalLM"),  # or V3: gguf_deepseek.deepseek2_config says
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}

MOE_ARCHS = frozenset({"qwen2moe", "qwen3moe"})

# "{arch}.<suffix>" metadata key -> HF config key (the same for every supported arch).
GGUF_ARCH_KEY_TO_HF_CONFIG: dict[str, str] = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}

# "{arch}.<suffix>" metadata key -> HF config key, only for the MoE block.
GGUF_MOE_KEY_TO_HF_CONFIG: dict[str, str] = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}

# Non-arch metadata key -> HF config key.
GGUF_TOKENIZER_KEY_TO_HF_CONFIG: dict[str, str] = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}

# llama.cpp routes top-k weights through a renormalisation for qwen3moe but not for qwen2moe;
# neither fact is stored in the file, so it is a per-arch constant.
NORM_TOPK_PROB_BY_ARCH: dict[str, bool] = {"qwen2moe": False, "qwen3moe": True}

# Whole-model GGUF tensor name -> HF parameter name.
GGUF_GLOBAL_TENSOR_TO_HF: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Per-layer GGUF tensor stem (between "blk.N." and ".weight"/".bias") -> HF module path
# under "model.layers.N.".
GGUF_LAYER_TENSOR_TO_HF: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # q, k and v stored as one (phi3)
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",  # Gemma's norm on the attention's output
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}

# Per-layer stems an architecture maps otherwise: phi3's ffn_up holds gate and up, as HF's gate_up_proj.
# Gemma's ffn_norm is the norm before its MLP (its post_attention_norm the one after attention).
GGUF_ARCH_LAYER_TENSOR_TO_HF: dict[str, dict[str, str]] = {"phi3": {"ffn_up": "mlp.gate_up_proj"},
                                                           "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
                                                           "gemma3_text": {"ffn_norm": "pre_feedforward_layernorm"}}

# What llama.cpp's converter adds to every norm weight of a model type (Gemma's norms scale by
# 1 + w; llama.cpp's by the weight): taken off again on load, so the HF tensor is the checkpoint's.
GGUF_NORM_SHIFT: dict[str, float] = {"gemma2": 1.0, "gemma3_text": 1.0}

# Whole-model tensors that are rotary tables, not weights: read into the config's rope scaling
# (gguf_metadata.py), never loaded as parameters. rope_freqs: llama 3.x's frequency divisors (its
# "llama3" scaling, as llama.cpp's converter computes them); rope_factors_*: phi3's LongRoPE sets.
GGUF_ROPE_FACTOR_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

# Stacked-expert GGUF tensor stem -> per-expert HF projection under "mlp.experts.E.".
GGUF_STACKED_EXPERT_TENSOR_TO_HF: dict[str, str] = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
