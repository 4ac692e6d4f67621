"""Collectives over one process group, with traffic counts.

Layers hold a `Communicator` for the group they shard over (never the WORLD group). With one
rank every operation returns its input untouched and counts nothing, which is what makes the
single-device engine and the tensor-parallel engine the same code.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Traffic:
    """Calls and bytes this rank contributed (the size of the tensor it passed in)."""

    calls: int = 0
    bytes: int = 0


class Communicator:
    """all_reduce / all_gather / broadcast on a group; `group=None` with size 1 means no peers."""

    def __init__(self, group: dist.ProcessGroup | None = None, rank: int = 0, size: int = 1):
        if size > 1 and group is None:
            raise ValueError("a Communicator for more than one rank needs a process group")
        self.group, self.rank, self.size = group, rank, size
        self.traffic: dict[str, Traffic] = defaultdict(Traffic)

    def _count(self, op: str, t: torch.Tensor) -> None:
        rec = self.traffic[op]
        rec.calls += 1
        rec.bytes += t.numel() * t.element_size()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum across ranks, in place; returns `t`."""
        if self.size == 1:
            return t
        self._count("all_reduce", t)
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `t` along `dim`; pieces may differ in size along `dim`."""
        if self.size == 1:
            return t
        self._count("all_gather", t)
        sizes = self._sizes_along(t, dim)
        shape = list(t.shape)
        pieces = []
        for s in sizes:
            shape[dim] = s
            pieces.append(t.new_empty(shape))
        t = t.contiguous()
        if len(set(sizes)) == 1:
            dist.all_gather(pieces, t, group=self.group)
        else:
            # gloo's all_gather needs equal sizes: broadcast each rank's piece instead.
            for r, p in enumerate(pieces):
                src = t if r == self.rank else p
                dist.broadcast(src, dist.get_global_rank(self.group, r), group=self.group)
                pieces[r] = src
        return torch.cat(pieces, dim=dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size == 1:
            return t
        self._count("broadcast", t)
        dist.broadcast(t, dist.get_global_rank(self.group, src), group=self.group)
        return t

    def _sizes_along(self, t: torch.Tensor, dim: int) -> list[int]:
        mine = torch.tensor([t.shape[dim]], dtype=torch.int64)
        out = [torch.zeros_like(mine) for _ in range(self.size)]
        dist.all_gather(out, mine, group=self.group)
        return [int(x) for x in out]

    def traffic_report(self) -> dict[str, dict[str, float]]:
        """Counts by operation, bytes as MB (10^6), for logs, /metrics and benchmarks."""
        return {op: {"calls": r.calls, "MB": r.bytes / 1e6} for op, r in sorted(self.traffic.items())}
