"""Qwen2-MoE: Qwen2 attention (q/k/v bias) with routed experts plus a sigmoid-gated shared expert."""

from torch import nn

from shardserve.models.blocks import CausalLM
from shardserve.models.qwen3_moe import moe_or_dense


class Qwen2MoeForCausalLM(CausalLM):
    def make_mlp(self, cfg, layer, comm, dtype, device) -> nn.Module:
        return moe_or_dense(cfg, layer, comm, dtype, device, self.expert_comm, self.placements)
