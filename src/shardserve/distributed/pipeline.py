"""Pipeline parallelism's two pieces: which layers a stage holds, and the point-to-point link
that carries a micro-batch's residual stream from one stage to the next.

Only the residual stream crosses a stage boundary: one [tokens, hidden] tensor per micro-batch,
sent by each rank to the rank at the same tensor-parallel position of the next stage. Every
stage handles micro-batches in the order the leader planned them, so sends and receives between
two stages always pair up in order; nothing waits on all ranks at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch

from shardserve.distributed.communicator import CollectiveError, Communicator
from shardserve.distributed.layout import LayoutError


@dataclass(frozen=True)
class Stage:
    """Stage `index` of `count` holds layers [start, end)."""

    index: int = 0
    count: int = 1
    start: int = 0
    end: int = 0

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def owns(self, layer: int) -> bool:
        return self.start <= layer < self.end


def split_layers(num_layers: int, pp: int, partition: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """Each stage's [start, end): `partition` (one layer count per stage) or an even split with
    the remainder spread over the first stages."""
    if pp > num_layers:
        raise LayoutError(f"--pp-size {pp} exceeds the model's {num_layers} layers")
    if partition:
        if len(partition) != pp or any(n < 1 for n in partition) or sum(partition) != num_layers:
            raise LayoutError(f"--pp-layer-partition {','.join(map(str, partition))} must be {pp} counts >= 1 "
                              f"(one per stage) summing to the model's {num_layers} layers")
        counts = list(partition)
    else:
        base, extra = divmod(num_layers, pp)
        counts = [base + (i < extra) for i in range(pp)]
    bounds, start = [], 0
    for n in counts:
        bounds.append((start, start + n))
        start += n
    return bounds


def stage_of(index: int, num_layers: int, pp: int, partition: tuple[int, ...] | None = None) -> Stage:
    start, end = split_layers(num_layers, pp, partition)[index]
    return Stage(index, pp, start, end)


class StageLink:
    """Receives the previous stage's residual stream and sends this stage's to the next.

    Sends are asynchronous so a stage can start its next micro-batch while the last one is on the
    wire; at most `max_pending` stay outstanding, each waited for at most `timeout_s`."""

    def __init__(self, comm: Communicator, stage: Stage, timeout_s: float, max_pending: int = 2):
        self.comm, self.stage = comm, stage
        self.timeout = timedelta(seconds=timeout_s)
        self.max_pending = max_pending
        self.pending: deque = deque()  # (work, tensor kept alive until sent)

    def recv(self, rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = torch.empty((rows, hidden), dtype=dtype, device=device)
        return self.comm.recv(buf, self.stage.index - 1)

    def send(self, x: torch.Tensor) -> None:
        x = x.contiguous()
        self.pending.append((self.comm.isend(x, self.stage.index + 1), x))
        while len(self.pending) > self.max_pending:
            self._wait_oldest()

    def flush(self) -> None:
        while self.pending:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        work, _ = self.pending.popleft()
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            peer = self.comm.members[self.stage.index + 1]
            raise CollectiveError(f"rank {self.comm.members[self.comm.rank]}: send of the residual stream to "
                                  f"stage {self.stage.index + 1} (rank {peer}) on the pipeline group failed: "
                                  f"{str(e).splitlines()[0]}") from e
