"""Llama (and SmolLM2, which is Llama): the shared decoder stack as it is."""

from shardserve.models.blocks import CausalLM


class LlamaForCausalLM(CausalLM):
    pass
