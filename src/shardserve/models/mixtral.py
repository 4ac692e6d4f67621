"""Mixtral: Mistral attention with a softmax top-2 MoE in every layer and no shared expert.

Its checkpoints name the MoE block `block_sparse_moe` and an expert's projections w1 (gate),
w3 (up) and w2 (down); they load into the shared MoE block under our names."""

from torch import nn

from shardserve.models.blocks import CausalLM
from shardserve.models.qwen3_moe import moe_or_dense


class MixtralForCausalLM(CausalLM):
    renames = ((".block_sparse_moe.", ".mlp."), (".w1.weight", ".gate_proj.weight"),
               (".w3.weight", ".up_proj.weight"), (".w2.weight", ".down_proj.weight"))

    def make_mlp(self, cfg, layer, comm, dtype, device) -> nn.Module:
        return moe_or_dense(cfg, layer, comm, dtype, device, self.expert_comm, self.placements)
