"""The leader's plans in flight (pipeline micro-batches, or under --async-scheduling the one
planned ahead) and the requests waiting for their results."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from shardserve.core import Request
from shardserve.distributed.communicator import CollectiveError
from shardserve.scheduler.overlap import plans_again
from shardserve.scheduler.plan_feed import Wait


@dataclass
class InFlight:
    """A planned micro-batch: when it left, and the requests waiting for its result (request,
    samples a token, scores prompt tokens), in plan order."""

    sent: float
    waits: list[Wait]


class InFlightPlans:
    """Plans by number, oldest first; `busy` counts, per request, the plans that answer it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.plans: dict[int, InFlight] = {}
        self.busy: Counter[str] = Counter()
        self.most = 0  # the most plans ever in flight at once

    def __len__(self) -> int:
        return len(self.plans)

    def add(self, mb: int, waits: list[Wait]) -> None:
        self.plans[mb] = InFlight(time.monotonic(), waits)
        self.most = max(self.most, len(self.plans))
        self.busy.update(w[0].request_id for w in waits)
        for req, sample, _ in waits:
            req.pending += sample  # a token on its way (--async-scheduling plans past it)

    def take(self, mb: int) -> list[Wait]:
        """The waits of plan `mb`, whose result arrived: it must be the oldest in flight."""
        oldest = next(iter(self.plans), None)
        if mb != oldest:
            what = f"micro-batch {oldest} was the oldest in flight" if oldest is not None else "none was in flight"
            raise CollectiveError(f"rank {self.rank}: a result for micro-batch {mb} arrived while {what}")
        waits = self.plans.pop(mb).waits
        for req, sample, _ in waits:
            rid = req.request_id
            self.busy[rid] -= 1
            if self.busy[rid] <= 0:
                del self.busy[rid]
            req.pending -= sample
        return waits

    def overdue(self, timeout: float) -> int | None:
        """The oldest plan's number if it has been out longer than `timeout` seconds."""
        mb = next(iter(self.plans), None)
        return mb if mb is not None and time.monotonic() - self.plans[mb].sent > timeout else None

    def blocked(self, ahead: bool, requests: dict[str, Request], max_model_len: int) -> set[str] | Counter[str]:
        """Requests the next plan may not take: those waiting for a result, but when planning
        `ahead` (--async-scheduling) not a decode whose next token one running plan samples."""
        if not ahead:
            return self.busy
        return {rid for rid, k in self.busy.items() if not plans_again(requests.get(rid), k, max_model_len)}
