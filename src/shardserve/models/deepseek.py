"""DeepSeek-V2, V2-Lite, V3 and R1: latent attention (layers/latent_attention.py) and DeepSeekMoE
(fine-grained routed experts beside plain shared ones; the first `first_k_dense_replace` layers
dense). V2 and V3 differ only in what model_config reads: the gate's rule, q's low-rank path."""

from torch import nn

from shardserve.layers.latent_attention import LatentAttention
from shardserve.models.blocks import FUSED, CausalLM
from shardserve.models.qwen3_moe import moe_or_dense


class DeepseekV2ForCausalLM(CausalLM):
    # q_proj is V2-Lite's own projection here, not a piece of a fused q/k/v.
    fused = {k: v for k, v in FUSED.items() if k not in ("q_proj", "k_proj", "v_proj")}
    renames = ((".mlp.shared_experts.", ".mlp.shared_expert."),)

    def make_attention(self, cfg, layer, comm, dtype, device) -> nn.Module:
        return LatentAttention(cfg, layer, comm, dtype, device)

    def make_mlp(self, cfg, layer, comm, dtype, device) -> nn.Module:
        return moe_or_dense(cfg, layer, comm, dtype, device, self.expert_comm, self.placements)
