"""The gated MLP (gate/up fused, column-split; down row-split): SiLU, or Gemma's tanh-approximated
GELU, of the gate times up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.distributed.communicator import Communicator
from shardserve.layers import cpu_ops, gpu_ops, quant_kernel
from shardserve.layers.linear import RowParallelLinear, merged_column_linear


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, comm: Communicator, dtype, device, reduce: bool = True,
                 activation: str = "silu"):
        super().__init__()
        self.activation = activation  # ModelConfig.mlp_activation
        self.gate_up_proj = merged_column_linear(hidden, [intermediate, intermediate], False, comm, dtype, device)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, comm, dtype, device, reduce=reduce)

    @property
    def takes_bf16_input(self) -> bool:
        """Whether forward takes x as bfloat16 rows already rounded (the gate/up product's)."""
        return self.gate_up_proj.takes_bf16_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        silu = self.activation == "silu"
        if silu and self.gate_up_proj.takes_bf16_input and self.down_proj.takes_bf16_input:
            # bfloat16 weights on vdpbf16ps, no adapter: SiLU in the gate/up product's epilogue.
            h = quant_kernel.gate_up_silu(x, self.gate_up_proj.quant)
            if h is not None:
                return self.down_proj(h)
        gate_up = self.gate_up_proj(x)
        h = cpu_ops.silu_mul(gate_up, bf16=self.down_proj.takes_bf16_input, activation=self.activation)
        if h is None and (not silu or (h := gpu_ops.silu_mul(gate_up)) is None):
            gate, up = gate_up.chunk(2, dim=-1)
            h = (F.silu(gate) if silu else F.gelu(gate, approximate="tanh")) * up
        return self.down_proj(h)
