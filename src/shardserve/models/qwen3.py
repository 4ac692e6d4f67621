"""Qwen3: Llama plus a per-head RMSNorm on q and k before RoPE."""

from shardserve.models.blocks import CausalLM


class Qwen3ForCausalLM(CausalLM):
    qk_norm = True
