"""What the API process knows of each data-parallel replica: serving, starting again, or down
for good, and what its deaths cost (for /health and /metrics)."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

log = logging.getLogger("shardserve.server")


@dataclass
class ReplicaStatus:
    state: str = "serving"  # serving | restarting | down
    restarts: int = 0  # times started again
    reason: str = ""  # why it last went down
    placed_again: int = 0  # requests it held that had streamed nothing, sent to another replica
    cut_off: int = 0  # requests it held that had streamed, ended with a 503


class ReplicaBoard:
    def __init__(self, num_replicas: int):
        self.replicas = [ReplicaStatus() for _ in range(num_replicas)]

    def down(self, replicas: tuple[int, ...], reason: str) -> None:
        for d in replicas:
            self.replicas[d].state, self.replicas[d].reason = "restarting", reason

    def up(self, replicas: tuple[int, ...], restarts: int) -> None:
        for d in replicas:
            self.replicas[d].state, self.replicas[d].restarts = "serving", restarts

    def gave_up(self, replicas: tuple[int, ...], reason: str) -> None:
        for d in replicas:
            self.replicas[d].state, self.replicas[d].reason = "down", reason

    @property
    def serving(self) -> int:
        return sum(r.state == "serving" for r in self.replicas)

    def health(self) -> dict:
        """/health's body: 'ok' with every replica serving, 'degraded' with some, 'unavailable' with none."""
        status = ("ok" if self.serving == len(self.replicas) else "degraded" if self.serving else "unavailable")
        return {"status": status, "replicas": [{"replica": d, **asdict(r)} for d, r in enumerate(self.replicas)]}
