"""Expert parallelism's dispatch and combine: tokens travel to the ranks owning their experts.

Experts are split whole over the expert group's ranks (contiguous, as even as possible). Per
MoE layer, two all-to-alls:

- dispatch: each token's row goes once to every *distinct* rank owning one of its top-k experts
  (two experts on one rank cost one row, not two), with its routing for that rank appended: k
  weights and k local expert indices (-1 and weight 0 where the expert lives elsewhere), so the
  receiver needs no gate of its own;
- combine: each receiving rank returns one row per row it got, the weighted sum of its experts'
  outputs for that token; the sender adds the partials up.

Bytes that leave a rank: dispatch = sum over its tokens of (distinct remote owner ranks) x
(hidden + 2k) x itemsize; combine = sum over the rows it received from others x hidden x
itemsize. A rank with no tokens still joins both calls with empty pieces.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardserve.distributed.communicator import Communicator
from shardserve.layers.sharding import split_range

# compute(rows [m, hidden], local expert indices [m, k] (-1: none), weights [m, k]) -> [m, hidden]
ExpertCompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertDispatch:
    def __init__(self, comm: Communicator, num_experts: int):
        self.comm = comm
        bounds = [split_range(num_experts, comm.size, r) for r in range(comm.size)]
        self.first = [b[0] for b in bounds]
        self.owner = torch.tensor([r for r, (lo, hi) in enumerate(bounds) for _ in range(lo, hi)])
        # Local indices travel in the activations' dtype: exact in bfloat16 up to 256.
        if max(hi - lo for lo, hi in bounds) > 256:
            raise ValueError(f"{num_experts} experts over {comm.size} ranks: more than 256 on one rank")

    def local_range(self) -> tuple[int, int]:
        """The experts this rank owns: [start, end)."""
        return split_range(len(self.owner), self.comm.size, self.comm.rank)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 compute: ExpertCompute) -> torch.Tensor:
        """The routed output for tokens `x` [n, hidden] whose top-k experts are `experts` [n, k]
        with `weights` [n, k]."""
        n, k = experts.shape
        hidden = x.shape[1]
        owner = self.owner.to(experts.device)[experts]  # [n, k]
        dest = torch.zeros(n, self.comm.size, dtype=torch.bool, device=x.device)
        dest.scatter_(1, owner, True)
        rows_for = [dest[:, r].nonzero(as_tuple=True)[0] for r in range(self.comm.size)]
        pieces = []
        for r, rows in enumerate(rows_for):
            mine = owner[rows] == r
            local = torch.where(mine, experts[rows] - self.first[r], -1).to(x.dtype)
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
