"""Qwen3-MoE: Qwen3 attention with sparse MoE MLPs (top-k router, optional norm_topk_prob)."""

from torch import nn

from shardserve.config import ModelConfig
from shardserve.distributed.communicator import Communicator
from shardserve.distributed.expert_placement import PlacementPlan
from shardserve.layers.mlp import GatedMLP
from shardserve.layers.moe import SparseMoE
from shardserve.models.blocks import CausalLM


def moe_or_dense(cfg: ModelConfig, layer: int, comm: Communicator, dtype, device,
                 expert: Communicator | None = None, placements: PlacementPlan | None = None) -> nn.Module:
    if cfg.is_moe_layer(layer):
        placement = placements.for_layer(layer, cfg.num_experts) if placements is not None else None
        return SparseMoE(cfg, comm, dtype, device, expert, placement)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, comm, dtype, device)


class Qwen3MoeForCausalLM(CausalLM):
    qk_norm = True

    def make_mlp(self, cfg, layer, comm, dtype, device) -> nn.Module:
        return moe_or_dense(cfg, layer, comm, dtype, device, self.expert_comm, self.placements)
