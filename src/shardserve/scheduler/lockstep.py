"""Data-parallel attention's agreement: every replica steps, or none does.

Under `--enable-dp-attention` each replica schedules its own requests, but every MoE layer is
one all-to-all over the ranks of *all* replicas. A collective completes only when every member
enters it, so no rank may skip a forward that another rank runs: a replica with no requests
must still run a forward over zero tokens (an empty plan) for as long as any replica has work,
or its peers wait inside the first MoE layer until the collective times out. And when no
replica has work, all of them must stop together, or the one that keeps stepping waits alone.

So the leaders agree once per step, over the `data` group (one all-reduce of four integers on
CPU): does anyone have work, is anyone shutting down, and the newest and oldest router wake
each has seen. Idle leaders sleep on their inbox rather than spin; what ends the sleep is the
router's numbered `Wake`, sent to every leader after each request it places (router/replicas.py).
A wake is acted on only if it is newer than the newest wake the last agreement saw, so every
leader wakes for the same reason, and a stale wake never drags one leader into a collective
alone. A leader that is behind (its wakes, and the request before them, are still in flight)
catches up before the next agreement, so a request sent just before everyone fell asleep is
never stranded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shardserve.distributed.communicator import CollectiveError, Communicator


@dataclass(frozen=True)
class Agreement:
    work: bool  # some replica has a request to run: every replica steps
    stop: bool  # some leader was told to shut down: every replica stops
    newest_wake: int
    oldest_wake: int  # the lowest "newest wake seen" over the leaders

    @property
    def settled(self) -> bool:
        """Every leader has seen every wake (and so every request) sent so far."""
        return self.newest_wake == self.oldest_wake


class Lockstep:
    """One leader's side of the agreement (the `data` group holds every replica's leader)."""

    def __init__(self, data: Communicator, timeout_s: float):
        self.comm, self.timeout_s = data, timeout_s
        self.wake_seen = 0  # the newest Wake this leader has received
        self.asleep_at: int | None = None  # the newest wake all had seen when all fell idle

    def saw_wake(self, seq: int) -> None:
        self.wake_seen = max(self.wake_seen, seq)

    def sleeping(self) -> bool:
        """Idle with nothing new: wait on the inbox instead of joining an agreement."""
        return self.asleep_at is not None and self.wake_seen <= self.asleep_at

    def agree(self, has_work: bool, stopping: bool) -> Agreement:
        flags = torch.tensor([int(has_work), int(stopping), self.wake_seen, -self.wake_seen], dtype=torch.int64)
        try:
            self.comm.all_reduce(flags, op="max")
        except CollectiveError as e:
            raise CollectiveError(f"{e} (the replicas' per-step agreement: a replica's leader is gone or stuck)") \
                from None
        a = Agreement(bool(flags[0]), bool(flags[1]), int(flags[2]), -int(flags[3]))
        self.asleep_at = a.newest_wake if not a.work and a.settled else None
        return a

    def behind(self, agreement: Agreement) -> bool:
        return self.wake_seen < agreement.newest_wake

    def check_catch_up(self, since: float, newest: int, rank: int) -> None:
        if time.monotonic() - since > self.timeout_s:
            raise CollectiveError(f"rank {rank}: wake {newest} from the router did not arrive within "
                                  f"{self.timeout_s:.0f} s (other replicas' leaders have seen it)")
