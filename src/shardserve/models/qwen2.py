"""Qwen2: Llama with biases on q/k/v (ModelConfig.attention_bias is true for qwen2 types)."""

from shardserve.models.blocks import CausalLM


class Qwen2ForCausalLM(CausalLM):
    pass
