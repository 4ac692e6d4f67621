"""Collectives over one process group, with traffic counts and named failures.

Layers hold a `Communicator` for the group they shard over (never the WORLD group). With one
rank every operation returns its input untouched and counts nothing, which is what makes the
single-device engine and the tensor-parallel engine the same code. A collective that fails or
times out raises `CollectiveError` naming the rank, the group and the operation.
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    pass


@dataclass
class Traffic:
    """Calls and bytes this rank contributed (the size of the tensor it passed in)."""

    calls: int = 0
    bytes: int = 0


class Communicator:
    """all_reduce / all_gather / all_to_all / broadcast / send / recv on one group."""

    def __init__(self, group: dist.ProcessGroup | None = None, rank: int = 0, size: int = 1, name: str = "tensor",
                 members: tuple[int, ...] | None = None, world_start: int = 0):
        """`rank` and `size` are within the group; `members` are the group's global ranks in order
        (from the layout, so addressing a peer needs no lookup). torch numbers the ranks of this
        process's world from `world_start` (an independent replica's first global rank) as 0."""
        if size > 1 and group is None:
            raise ValueError("a Communicator for more than one rank needs a process group")
        self.group, self.rank, self.size, self.name = group, rank, size, name
        self.members = members or tuple(range(size))
        self.world_start = world_start
        self.traffic: dict[str, Traffic] = defaultdict(Traffic)

    def _count(self, op: str, t: torch.Tensor) -> None:
        rec = self.traffic[op]
        rec.calls += 1
        rec.bytes += t.numel() * t.element_size()

    def _run(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, group=self.group, **kwargs)
        except (RuntimeError, ValueError) as e:
            raise CollectiveError(f"rank {self.members[self.rank]}: {what} on the {self.name} group failed: {e}") from e

    def _torch_rank(self, rank: int) -> int:
        """Group rank -> the rank torch calls take (in this process's world)."""
        return self.members[rank] - self.world_start

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce across ranks in place (op: sum, min or max); returns `t`."""
        if self.size == 1:
            return t
        self._count("all_reduce", t)
        red = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
        self._run("all_reduce", dist.all_reduce, t, op=red)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
        """Concatenate every rank's `t` along `dim`. Pieces are equal unless `sizes` (every
        rank's length along `dim`, which callers know from how they split) says otherwise."""
        if self.size == 1:
            return t
        self._count("all_gather", t)
        dim = dim % t.dim()
        sizes = sizes or [t.shape[dim]] * self.size
        t = t.contiguous()
        if len(set(sizes)) == 1:
            pieces = [torch.empty_like(t) for _ in sizes]
            self._run("all_gather", dist.all_gather, pieces, t)
            return torch.cat(pieces, dim=dim)
        # Uneven pieces: pad to the largest, gather, trim (gloo's all_gather needs equal sizes).
        width = max(sizes)
        pad = list(t.shape)
        pad[dim] = width - t.shape[dim]
        padded = torch.cat([t, t.new_zeros(pad)], dim=dim) if pad[dim] else t
        pieces = [torch.empty_like(padded) for _ in sizes]
        self._run("all_gather", dist.all_gather, pieces, padded)
        return torch.cat([p.narrow(dim, 0, s) for p, s in zip(pieces, sizes)], dim=dim)

    def all_to_all(self, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send pieces[r] to rank r; return what each rank sent here. Pieces may be uneven along
        dim 0, and empty. gloo has no all_to_all, so this pairs sends and receives, sizes
        exchanged first (on the pieces' device: NCCL refuses CPU tensors). Counted: one call, the
        bytes of the pieces that leave this rank."""
        if self.size == 1:
            return [pieces[0]]
        rec = self.traffic["all_to_all"]
        rec.calls += 1
        rec.bytes += sum(p.numel() * p.element_size() for r, p in enumerate(pieces) if r != self.rank)
        device = pieces[self.rank].device
        counts = torch.tensor([p.shape[0] for p in pieces], dtype=torch.int64, device=device)
        incoming = [torch.zeros_like(counts) for _ in range(self.size)]
        self._count("all_to_all_sizes", counts)  # a collective too: every one is counted
        self._run("all_to_all", dist.all_gather, incoming, counts)
        rest = pieces[self.rank].shape[1:]
        out = [t.new_empty((int(incoming[src][self.rank]), *rest)) if src != self.rank else pieces[src]
               for src, t in enumerate(pieces)]
        ops = []
        for peer in range(self.size):
            # Both sides know every size by now: an empty piece is neither sent nor awaited.
            if peer != self.rank and pieces[peer].shape[0]:
                ops.append(dist.P2POp(dist.isend, pieces[peer].contiguous(), self._torch_rank(peer), self.group))
            if peer != self.rank and out[peer].shape[0]:
                ops.append(dist.P2POp(dist.irecv, out[peer], self._torch_rank(peer), self.group))
        for work in self._run("all_to_all", _batch_p2p, ops) if ops else []:
            work.wait()
        return out

    def ring_exchange(self, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> list:
        """Start sending `sends` to the next rank of the ring and filling `recvs` from the previous
        one (each side's empty tensors skipped: both know every length); returns the work handles
        for `wait_all`. Counted: one "ring" call, the bytes sent."""
        nxt, prev = self._torch_rank((self.rank + 1) % self.size), self._torch_rank((self.rank - 1) % self.size)
        rec = self.traffic["ring"]
        rec.calls += 1
        rec.bytes += sum(t.numel() * t.element_size() for t in sends)
        ops = [dist.P2POp(dist.isend, t, nxt, self.group) for t in sends if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, prev, self.group) for t in recvs if t.numel()]
        return self._run("ring exchange", _batch_p2p, ops) if ops else []

    def wait_all(self, works: list, what: str) -> None:
        """Wait for started transfers; a failure names this rank, the group and `what`."""
        try:
            for work in works:
                work.wait()
        except (RuntimeError, ValueError) as e:
            raise CollectiveError(f"rank {self.members[self.rank]}: {what} on the {self.name} group failed: "
                                  f"{str(e).splitlines()[0]}") from e

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size == 1:
            return t
        self._count("broadcast", t)
        self._run("broadcast", dist.broadcast, t, self._torch_rank(src))
        return t

    def send(self, t: torch.Tensor, dst: int) -> None:
        self._count("send", t)
        self._run("send", dist.send, t.contiguous(), self._torch_rank(dst))

    def isend(self, t: torch.Tensor, dst: int):
        """Start sending `t` (contiguous, kept alive by the caller) to group rank `dst`; returns
        the work handle to wait on."""
        self._count("send", t)
        return self._run("send", _isend, t, self._torch_rank(dst))

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Fill `t` from group rank `src`; the group's timeout bounds the wait."""
        try:
            dist.recv(t, self._torch_rank(src), group=self.group)
        except (RuntimeError, ValueError) as e:
            me = self.members[self.rank]
            raise CollectiveError(f"rank {me}: recv from rank {self.members[src]} on the {self.name} group "
                                  f"failed: {str(e).splitlines()[0]}") from e
        return t

    def count(self, op: str, nbytes: int) -> None:
        """Count traffic this group's ranks exchange by other means (ZeroMQ: plans, results)."""
        rec = self.traffic[op]
        rec.calls += 1
        rec.bytes += nbytes

    def gather_objects(self, obj) -> list:
        """Every rank's picklable `obj`, in rank order, on every rank (for reports, not hot paths)."""
        if self.size == 1:
            return [obj]
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
        self._count("gather_objects", length)
        lengths = [int(n) for n in self._run("gather_objects", _all_gather_list, length, self.size)]
        self._count("gather_objects", data)
        padded = torch.cat([data, data.new_zeros(max(lengths) - data.numel())])
        pieces = self._run("gather_objects", _all_gather_list, padded, self.size)
        return [pickle.loads(p[:n].numpy().tobytes()) for p, n in zip(pieces, lengths)]

    def barrier(self) -> None:
        if self.size > 1:
            self._count("barrier", torch.empty(0))
            self._run("barrier", dist.barrier)

    def traffic_report(self) -> dict[str, dict[str, float]]:
        """Counts by operation, bytes as MB (10^6), for logs, /metrics and benchmarks."""
        return {op: {"calls": r.calls, "MB": r.bytes / 1e6} for op, r in sorted(self.traffic.items())}


def _all_gather_list(t: torch.Tensor, size: int, group=None) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t, group=group)
    return out


def _isend(t: torch.Tensor, dst: int, group=None):
    return dist.isend(t, dst, group=group)


def _batch_p2p(ops: list, group=None) -> list:
    return dist.batch_isend_irecv(ops)
