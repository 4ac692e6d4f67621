"""Set up torch.distributed for one scheduler rank and build its named groups.

Two groups over the same ranks: `tp` carries tensors (NCCL on GPUs, gloo on CPU) and `control`
carries scheduling agreement (always gloo, CPU tensors). Layers only ever see `tp`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shardserve.distributed.communicator import Communicator
from shardserve.platform import collective_backend


@dataclass
class ParallelGroups:
    tp: Communicator
    control: Communicator


def single_process_groups() -> ParallelGroups:
    return ParallelGroups(Communicator(name="tp"), Communicator(name="control"))


def init_distributed(rank: int, world: int, master: str, device: torch.device, timeout_s: float) -> ParallelGroups:
    """`master` is host:port of rank 0's rendezvous. Every collective times out after `timeout_s`."""
    timeout = timedelta(seconds=timeout_s)
    backend = collective_backend(device)
    dist.init_process_group("gloo" if backend == "gloo" else "cpu:gloo,cuda:nccl",
                            init_method=f"tcp://{master}", rank=rank, world_size=world, timeout=timeout)
    ranks = list(range(world))
    tp = dist.new_group(ranks, backend=backend, timeout=timeout)
    control = dist.new_group(ranks, backend="gloo", timeout=timeout)
    return ParallelGroups(Communicator(tp, rank, world, "tp"), Communicator(control, rank, world, "control"))


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
