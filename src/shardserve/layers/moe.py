"""Mixture-of-experts block (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeekMoE; the gate: layers/moe_gate.py).

Under tensor parallelism experts are split whole: each rank owns a contiguous range of experts,
sees every token, computes only its experts, and one all-reduce sums the routed partials and
(Qwen2-MoE) the column/row-split shared expert's partial together.

Under expert parallelism (`expert` communicator of more than one rank) experts live in slots
over the expert group instead, as a `Placement` says (default: whole and contiguous, one slot
each; with hot-expert replicas a hot expert fills a slot on several ranks, each loaded with the
same checkpoint tensors), and tokens travel to them (layers/expert_dispatch.py). The tensor
group's ranks hold the same tokens, so each dispatches only its contiguous share of them; one
all-reduce over the tensor group then sums the shares (disjoint rows) and the shared expert's
partial, as under tensor parallelism. With one rank per tensor group (data-parallel attention,
one rank per replica) that all-reduce is nothing.

Every forward also counts routing, for `shardserve record-experts` and /metrics: `routed` (per
logical expert, the token-expert pairs the gate chose for every token of this rank's tensor
group: its replica's full count) and `computed` (the pairs this rank's slots computed: its
expert load).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.config import ModelConfig
from shardserve.distributed.communicator import Communicator
from shardserve.distributed.expert_placement import Placement
from shardserve.layers import quant_kernel
from shardserve.layers.expert_dispatch import ExpertDispatch
from shardserve.layers.linear import (
    ReplicatedLinear,
    apply_linear,
    copy_into,
    make_param,
    merge_segments,
    pack_weight,
    packable,
)
from shardserve.layers.mlp import GatedMLP
from shardserve.layers.moe_gate import MoEGate
from shardserve.layers.sharding import split_range
from shardserve.loader.quantized import QuantWeight

# Checkpoint projection name -> (which stacked tensor, which half of gate/up).
EXPERT_PIECES = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}


class SparseMoE(nn.Module):
    """Top-k routed experts; an optional shared expert, with a sigmoid gate (Qwen2-MoE) or
    without (DeepSeek's `shared_experts`, several fused into one MLP as its checkpoints store them)."""

    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype, device, expert: Communicator | None = None,
                 placement: Placement | None = None):
        """`placement`: where experts live over `expert`'s ranks (expert parallelism only)."""
        super().__init__()
        self.comm = comm
        self.num_experts = cfg.num_experts
        ep = expert is not None and expert.size > 1
        if placement is not None and not ep:
            raise ValueError("an expert placement needs expert parallelism (an expert group of more than one rank)")
        self.dispatch = ExpertDispatch(expert, cfg.num_experts, placement) if ep else None
        # The logical expert in each local slot; without EP, the contiguous range [e0, e0 + n).
        self.e0 = 0 if ep else split_range(cfg.num_experts, comm.size, comm.rank)[0]
        self.slots: tuple[int, ...] = (self.dispatch.slots if self.dispatch is not None else
                                       tuple(range(*split_range(cfg.num_experts, comm.size, comm.rank))))
        self._slots_of: dict[int, list[int]] = {}
        for i, e in enumerate(self.slots):
            self._slots_of.setdefault(e, []).append(i)
        n_local, h, inter = len(self.slots), cfg.hidden_size, cfg.moe_intermediate_size
        held = sorted(self._slots_of)
        self.gate = MoEGate(h, cfg.num_experts, cfg.num_experts_per_tok, cfg.router, dtype, device)
        self.w13 = make_param((n_local, 2 * inter, h), dtype, device, self._load,
                              [(e, p) for e in held for p in ("gate_proj", "up_proj")])
        self.w2 = make_param((n_local, h, inter), dtype, device, self._load, [(e, "down_proj") for e in held])
        self.packed: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        # A GGUF's experts under --quantization auto: per slot, gate/up and down as row segments.
        self.quant: list[tuple[tuple, tuple]] = []
        self._qpieces: dict[tuple[int, str], QuantWeight] = {}
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(h, cfg.shared_expert_intermediate_size, comm, dtype, device, reduce=False)
            if cfg.shared_expert_gated:
                self.shared_expert_gate = ReplicatedLinear(h, 1, False, dtype, device)
        # Plain attributes, not buffers: counters are no checkpoint tensors.
        self.routed = torch.zeros(cfg.num_experts, dtype=torch.int64, device=device)
        self.computed = 0

    def reset_counts(self) -> None:
        self.routed.zero_()
        self.computed = 0

    def _load(self, param: nn.Parameter, src, shard_id) -> None:
        expert, proj = shard_id
        slots = self._slots_of.get(expert)
        if not slots:
            return  # another rank's expert: never read
        _, half = EXPERT_PIECES[proj]
        q = src.read_quantized()
        if q is not None:  # kept in its blocks (see process_after_loading)
            self._qpieces.update({(i, proj): q for i in slots})
            return
        data = src.read()
        for i in slots:  # a replicated expert fills every local slot holding it
            dst = param.data[i]
            if half is not None:
                rows = dst.shape[0] // 2
                dst = dst.narrow(0, half * rows, rows)
            copy_into(dst, data, src.name)

    def process_after_loading(self) -> None:
        """Experts that all came block-quantized stay so (the dense stacks dropped); else any that
        did are expanded into the stacks. Then, where oneDNN applies (see
        layers/linear.pack_weight), each local expert's matrices are packed one by one and the
        dense stacks dropped."""
        pieces, self._qpieces = self._qpieces, {}
        n, inter = self.w13.shape[0], self.w13.shape[1] // 2
        if pieces and len(pieces) == 3 * n:
            self.quant = [(merge_segments({0: pieces[i, "gate_proj"], inter: pieces[i, "up_proj"]}),
                           merge_segments({0: pieces[i, "down_proj"]})) for i in range(n)]
            self.w13 = self.w2 = None
            return
        for (i, proj), q in pieces.items():
            stack, half = EXPERT_PIECES[proj]
            dst = self.w13.data[i, half * inter: (half + 1) * inter] if stack == "w13" else self.w2.data[i]
            dst.copy_(quant_kernel.dequantize(q))
        if n == 0 or not packable(self.w13):
            return
        self.packed = [(pack_weight(self.w13[i]), pack_weight(self.w2[i])) for i in range(self.w13.shape[0])]
        self.w13 = self.w2 = None

    def expert(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if self.quant:
            gate_up, down = self.quant[i]
            gate, up = quant_kernel.linear(x, gate_up, sum(q.rows for _, q in gate_up)).chunk(2, dim=-1)
            return quant_kernel.linear(F.silu(gate) * up, down, down[0][1].rows)
        if self.packed:
            gate, up = apply_linear(x, None, self.packed[i][0]).chunk(2, dim=-1)
            return apply_linear(F.silu(gate) * up, None, self.packed[i][1])
        gate, up = F.linear(x, self.w13[i]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w2[i])

    def local_experts(self, x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Per row, the weighted sum of this rank's slots among `local` (indices into this
        rank's slots; -1 or out of range: elsewhere). The (row, k) pairs are sorted by slot once
        (stable: each slot's rows stay ascending) and one copy of the counts reaches the host,
        rather than a nonzero, and a sync, per slot."""
        out = torch.zeros_like(x)
        n, k = len(self.slots), local.shape[1]
        flat = local.flatten()
        key = torch.where((flat >= 0) & (flat < n), flat, n)  # elsewhere: sorted last, never computed
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=n + 1)[:n].tolist()
        rows, which = order // k, order % k
        start = 0
        for i, c in enumerate(counts):
            if c:
                r, s = rows[start : start + c], which[start : start + c]
                out.index_add_(0, r, self.expert(i, x[r]) * weights[r, s].unsqueeze(-1))
                start += c
        self.computed += sum(counts)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dispatch is None:
            weights, experts = self.gate.route(x)
            out = self.local_experts(x, experts - self.e0, weights)
        else:
            out = torch.zeros_like(x)
            # Every tensor rank routes every token (the gate is a small matmul), so each holds its
            # replica's full routing counts, then dispatches only its contiguous share.
            weights, experts = self.gate.route(x)
            a, b = split_range(x.shape[0], self.comm.size, self.comm.rank)
            out[a:b] = self.dispatch(x[a:b], weights[a:b], experts[a:b], self.local_experts)
        self.routed += torch.bincount(experts.flatten(), minlength=self.num_experts)
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return self.comm.all_reduce(out)
