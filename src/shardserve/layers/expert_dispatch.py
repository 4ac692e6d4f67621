"""Expert parallelism's dispatch and combine: tokens travel to the ranks holding their experts.

Where experts live is a `Placement` (distributed/expert_placement.py): per rank, the logical
expert in each local slot. The default is today's split, whole and contiguous; with hot-expert
replicas (EPLB) an expert may have copies on several ranks. Per MoE layer, two all-to-alls:

- dispatch: each (token, expert) pair is first given ONE copy of the expert: the sender's own
  copy if it holds one (no traffic), else copy (row + sender rank) mod copies, in `owners` order
  (rank order). Senders hold equal shares of the tokens, so every copy ends up with about the
  same share of the expert's tokens. Then each token's row goes once to every *distinct* rank
  so chosen (two experts on one rank cost one row, not two), with its routing for that rank
  appended: k weights and k local slot indices (-1 and weight 0 where the pair went elsewhere),
  so the receiver needs no gate of its own;
- combine: each receiving rank returns one row per row it got, the weighted sum of its slots'
  outputs for that token; the sender adds the partials up.

Bytes that leave a rank: dispatch = sum over its tokens of (distinct remote destination ranks) x
(hidden + 2k) x itemsize; combine = sum over the rows it received from others x hidden x
itemsize. A rank with no tokens still joins both calls with empty pieces.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardserve.distributed.communicator import Communicator
from shardserve.distributed.expert_placement import Placement

# compute(rows [m, hidden], local slot indices [m, k] (-1: none), weights [m, k]) -> [m, hidden]
ExpertCompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertDispatch:
    def __init__(self, comm: Communicator, num_experts: int, placement: Placement | None = None):
        self.comm = comm
        self.placement = placement = placement or Placement.contiguous(num_experts, comm.size)
        if placement.num_experts != num_experts or placement.ranks != comm.size:
            raise ValueError(f"placement of {placement.num_experts} experts over {placement.ranks} ranks does not "
                             f"fit {num_experts} experts over {comm.size} ranks")
        # Local indices travel in the activations' dtype: exact in bfloat16 up to 256.
        if max(len(s) for s in placement.slots) > 256:
            raise ValueError(f"{num_experts} experts over {comm.size} ranks: more than 256 slots on one rank")
        owners = [placement.owners(e) for e in range(num_experts)]
        width = max(len(o) for o in owners)
        # Per expert, its copies' (rank, slot) padded to `width` (padding is never chosen).
        self.num_copies = torch.tensor([len(o) for o in owners])
        self.copy_rank = torch.tensor([[r for r, _ in o] + [0] * (width - len(o)) for o in owners])
        self.copy_slot = torch.tensor([[s for _, s in o] + [0] * (width - len(o)) for o in owners])
        mine = [[c for c, (r, _) in enumerate(o) if r == comm.rank] for o in owners]
        self.own_copy = torch.tensor([m[0] if m else -1 for m in mine])
        self._tables: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        # Rows dispatched to each rank so far (this rank's included): what the traffic counts
        # should follow from, kept apart from them so benchmarks can check the arithmetic.
        self.rows_to = [0] * comm.size

    def _on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        # Copied to the device once, not on every layer call of every step.
        if device not in self._tables:
            self._tables[device] = tuple(t.to(device) for t in (self.num_copies, self.own_copy, self.copy_rank,
                                                                 self.copy_slot))
        return self._tables[device]

    @property
    def slots(self) -> tuple[int, ...]:
        """The logical expert in each of this rank's local slots."""
        return self.placement.slots[self.comm.rank]

    def destinations(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rank, local slot) that computes each (token, expert) pair of `experts` [n, k]."""
        num_copies, own_copy, copy_rank, copy_slot = self._on(experts.device)
        row = torch.arange(experts.shape[0], device=experts.device).unsqueeze(1)
        spread = (row + self.comm.rank) % num_copies[experts]
        own = own_copy[experts]
        copy = torch.where(own >= 0, own, spread)
        return copy_rank[experts, copy], copy_slot[experts, copy]

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 compute: ExpertCompute) -> torch.Tensor:
        """The routed output for tokens `x` [n, hidden] whose top-k experts are `experts` [n, k]
        with `weights` [n, k]."""
        n, k = experts.shape
        hidden = x.shape[1]
        owner, slot = self.destinations(experts)  # [n, k] each
        dest = torch.zeros(n, self.comm.size, dtype=torch.bool, device=x.device)
        dest.scatter_(1, owner, True)
        # Every destination's rows, ascending, from one stable sort; its counts reach the host once.
        counts = dest.sum(0).tolist()
        order = torch.argsort((~dest.t()).flatten().to(torch.uint8), stable=True)[: sum(counts)] % max(n, 1)
        rows_for = list(order.split(counts))
        pieces = []
        for r, rows in enumerate(rows_for):
            self.rows_to[r] += rows.numel()
            mine = owner[rows] == r
            local = torch.where(mine, slot[rows], -1).to(x.dtype)
            w = torch.where(mine, weights[rows], 0).to(x.dtype)
            pieces.append(torch.cat([x[rows], w, local], dim=1))
        got = self.comm.all_to_all(pieces)
        sizes = [p.shape[0] for p in got]
        recv = torch.cat(got) if got else x.new_zeros(0, hidden + 2 * k)
        partial = compute(recv[:, :hidden], recv[:, hidden + k:].round().long(), recv[:, hidden:hidden + k])
        back = self.comm.all_to_all(list(partial.split(sizes)))
        out = torch.zeros_like(x)
        for rows, part in zip(rows_for, back):
            out.index_add_(0, rows, part)
        return out
