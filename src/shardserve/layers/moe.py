"""Mixture-of-experts block (Qwen3-MoE, Qwen2-MoE).

Under tensor parallelism experts are split whole: each rank owns a contiguous range of experts,
sees every token, computes only its experts, and one all-reduce sums the routed partials and
(Qwen2-MoE) the column/row-split shared expert's partial together.

Under expert parallelism (`expert` communicator of more than one rank) experts are split whole
over the expert group instead, and tokens travel to them (layers/expert_dispatch.py). The
tensor group's ranks hold the same tokens, so each dispatches only its contiguous share of them;
one all-reduce over the tensor group then sums the shares (disjoint rows) and the shared
expert's partial, as under tensor parallelism. With one rank per tensor group (data-parallel
attention, one rank per replica) that all-reduce is nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.config import ModelConfig
from shardserve.distributed.communicator import Communicator
from shardserve.layers.expert_dispatch import ExpertDispatch
from shardserve.layers.linear import ReplicatedLinear, apply_linear, copy_into, make_param, pack_weight, packable
from shardserve.layers.mlp import GatedMLP
from shardserve.layers.sharding import split_range

# Checkpoint projection name -> (which stacked tensor, which half of gate/up).
EXPERT_PIECES = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}


class SparseMoE(nn.Module):
    """Top-k routed experts; optional shared expert with a sigmoid gate (Qwen2-MoE)."""

    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype, device, expert: Communicator | None = None):
        super().__init__()
        self.comm, self.top_k, self.norm_topk = comm, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.dispatch = ExpertDispatch(expert, cfg.num_experts) if expert is not None and expert.size > 1 else None
        self.e0, self.e1 = (self.dispatch.local_range() if self.dispatch is not None
                            else split_range(cfg.num_experts, comm.size, comm.rank))
        n_local, h, inter = self.e1 - self.e0, cfg.hidden_size, cfg.moe_intermediate_size
        local = range(self.e0, self.e1)
        self.gate = ReplicatedLinear(h, cfg.num_experts, False, dtype, device)
        self.w13 = make_param((n_local, 2 * inter, h), dtype, device, self._load,
                              [(e, p) for e in local for p in ("gate_proj", "up_proj")])
        self.w2 = make_param((n_local, h, inter), dtype, device, self._load, [(e, "down_proj") for e in local])
        self.packed: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(h, cfg.shared_expert_intermediate_size, comm, dtype, device, reduce=False)
            self.shared_expert_gate = ReplicatedLinear(h, 1, False, dtype, device)

    def _load(self, param: nn.Parameter, src, shard_id) -> None:
        expert, proj = shard_id
        if not self.e0 <= expert < self.e1:
            return  # another rank's expert: never read
        _, half = EXPERT_PIECES[proj]
        dst = param.data[expert - self.e0]
        if half is not None:
            rows = dst.shape[0] // 2
            dst = dst.narrow(0, half * rows, rows)
        copy_into(dst, src.read(), src.name)

    def process_after_loading(self) -> None:
        """Where oneDNN applies (see layers/linear.pack_weight), each local expert's matrices are
        packed one by one and the dense stacks dropped."""
        if self.w13.shape[0] == 0 or not packable(self.w13):
            return
        self.packed = [(pack_weight(self.w13[i]), pack_weight(self.w2[i])) for i in range(self.w13.shape[0])]
        self.w13 = self.w2 = None

    def expert(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            gate, up = apply_linear(x, None, self.packed[i][0]).chunk(2, dim=-1)
            return apply_linear(F.silu(gate) * up, None, self.packed[i][1])
        gate, up = F.linear(x, self.w13[i]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w2[i])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) of each token's top-k, both [n, k]."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), experts

    def local_experts(self, x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Per row, the weighted sum of this rank's experts among `local` (indices into this
        rank's experts; -1 or out of range: elsewhere)."""
        out = torch.zeros_like(x)
        for i in range(self.e1 - self.e0):
            rows, slot = (local == i).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, self.expert(i, x[rows]) * weights[rows, slot].unsqueeze(-1))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dispatch is None:
            weights, experts = self.route(x)
            out = self.local_experts(x, experts - self.e0, weights)
        else:
            out = torch.zeros_like(x)
            a, b = split_range(x.shape[0], self.comm.size, self.comm.rank)  # this rank's share
            weights, experts = self.route(x[a:b])
            out[a:b] = self.dispatch(x[a:b], weights, experts, self.local_experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.comm.all_reduce(out)
