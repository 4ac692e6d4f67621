"""Set up torch.distributed for one rank and build every group of the rank grid.

`ParallelGroups` is the one answer to "where am I": the layout, this rank's global rank, and a
`Communicator` for each group kind it belongs to (a size-1 one where the group is just itself).
Tensor-carrying groups use NCCL on GPUs and gloo on CPU; `control` and `data` (scheduling
agreement: within a replica, and between the leaders of data-parallel attention's replicas, which
never exchange activations over it) are always gloo on CPU tensors. Layers receive only the
communicators they shard over.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shardserve.distributed.communicator import Communicator
from shardserve.distributed.layout import Coords, Layout
from shardserve.platform import collective_backend


@dataclass
class ParallelGroups:
    layout: Layout
    rank: int
    tensor: Communicator
    context: Communicator
    pipeline: Communicator
    data: Communicator
    control: Communicator
    expert: Communicator
    moe_tp: Communicator
    device_index: int | None = None  # the launcher's choice of GPU (RankSpec.device_index)

    @property
    def coords(self) -> Coords:
        return self.layout.coords(self.rank)

    @property
    def local_rank(self) -> int:
        """Index among this machine's ranks: picks the GPU."""
        return self.layout.local_rank(self.rank) if self.device_index is None else self.device_index

    @property
    def label(self) -> str:
        """How logs name this rank, e.g. 'rank 3 (node 1, tp 1)': sizes of 1 are left out."""
        c, grid = self.coords, self.layout
        parts = [f"node {grid.node_of(self.rank)}"] if grid.nnodes > 1 else []
        parts += [f"{a} {getattr(c, a)}" for a in ("dp", "pp", "cp", "tp") if getattr(grid, a) > 1]
        return f"rank {self.rank}" + (f" ({', '.join(parts)})" if parts else "")

    def communicators(self) -> dict[str, Communicator]:
        return {kind: getattr(self, kind) for kind in ("tensor", "context", "pipeline", "data", "control",
                                                       "expert", "moe_tp")}

    def traffic_by_group(self) -> dict:
        """This rank's counts on every group it is in: {"rank": r, "groups": {kind: report}}."""
        return {"rank": self.rank, "groups": {kind: c.traffic_report() for kind, c in self.communicators().items()
                                              if c.size > 1}}


def single_process_groups(layout: Layout | None = None) -> ParallelGroups:
    layout = layout or Layout()
    if layout.world != 1:
        raise ValueError(f"a single process cannot hold a layout of {layout.world} ranks")
    return ParallelGroups(layout, 0, **{kind: Communicator(name=kind) for kind in _KINDS})


_KINDS = ("tensor", "context", "pipeline", "data", "control", "expert", "moe_tp")
CPU_KINDS = ("control", "data")  # agreement on scheduling, small CPU tensors


def init_distributed(layout: Layout, rank: int, master: str, device: torch.device,
                     timeout_s: float) -> ParallelGroups:
    """`master` is host:port of the rendezvous, or `env://` under torchrun (its agent's store).
    Every collective times out after `timeout_s`."""
    timeout = timedelta(seconds=timeout_s)
    backend = collective_backend(device)
    init = master if "://" in master else f"tcp://{master}"
    eager = {}
    if device.type == "cuda":
        # The rank's own GPU before any allocation that names none, and NCCL's communicators made
        # now, eagerly: PyTorch documents batch_isend_irecv hangs over lazily made ones.
        torch.cuda.set_device(device)
        eager = {"device_id": device}
    # Independent replicas meet at rendezvous of their own (launch/ranks.py): torch's world is
    # the replica, whose ranks torch numbers from 0. Under torchrun there is one world.
    world = (layout.replica_ranks(layout.coords(rank).dp) if layout.independent_replicas and master != "env://"
             else range(layout.world))
    dist.init_process_group("gloo" if backend == "gloo" else "cpu:gloo,cuda:nccl", init_method=init,
                            rank=rank - world.start, world_size=len(world), timeout=timeout, **eager)
    comms = {kind: Communicator(name=kind) for kind in _KINDS}
    # Every rank creates every group in this one order, members or not (torch requires it).
    for kind, members in layout.creation_order(within=world):
        group = dist.new_group([m - world.start for m in members], backend="gloo" if kind in CPU_KINDS else backend,
                               timeout=timeout)
        if rank in members:
            comms[kind] = Communicator(group, members.index(rank), len(members), kind, members, world.start)
    return ParallelGroups(layout, rank, **comms)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
