"""Replicas that are started again: the watchdog of a grid whose replicas can die alone.

With `--dp-size D` the replicas never meet (each is its own torch.distributed world), so when a
rank of one dies, the others go on serving: its remaining ranks are stopped, and after a backoff
its processes are started afresh (weights loaded again). Under data-parallel attention every MoE
layer spans all replicas, so they form one unit, stopped and started together.

`Supervisor` runs one thread that owns the process tree from the end of start-up: it reads the
start-up reports of restarted ranks and polls for deaths. A death outside every unit (a
tokenizer, the router) is the old failure: the whole server ends. A unit is started again at
most `limit` times in a row (a unit that serves `RESET_AFTER` s has its count cleared); after
that it stays down. When every unit is down for good, the grid has failed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from shardserve.ipc.messages.lifecycle import Failed, Ready
from shardserve.launch.process_tree import Child, ProcessTree, failure

log = logging.getLogger("shardserve.launch")
RESET_AFTER = 300.0  # seconds of serving after which a unit's restarts are forgiven
MAX_BACKOFF = 30.0
STOP_GRACE = 2.0  # a dead unit's other ranks: their state is lost anyway


class ReplicaEvents(Protocol):
    """What the supervisor tells its owner (called on the supervisor's thread)."""

    def down(self, replicas: tuple[int, ...], reason: str) -> None: ...
    def up(self, replicas: tuple[int, ...], restarts: int) -> None: ...
    def gave_up(self, replicas: tuple[int, ...], reason: str) -> None: ...
    def failed(self, reason: str) -> None: ...


@dataclass
class Unit:
    """Ranks that die and start again together, and the replicas they serve."""

    replicas: tuple[int, ...]
    names: list[str]
    state: str = "serving"  # serving | waiting (backoff) | starting | down (for good)
    restarts: int = 0  # in a row
    total_restarts: int = 0
    since: float = field(default_factory=time.monotonic)  # when it last began serving
    start_at: float = 0.0  # waiting: when to start again
    deadline: float = 0.0  # starting: when to give the start up
    pending: set[str] = field(default_factory=set)  # starting: ranks not ready yet

    @property
    def label(self) -> str:
        return (f"replica {self.replicas[0]}" if len(self.replicas) == 1
                else f"replicas {', '.join(map(str, self.replicas))}")

    @property
    def them(self) -> str:
        return "it" if len(self.replicas) == 1 else "them"


def backoff(restart: int) -> float:
    """Seconds before restart number `restart` (1-based) of a unit: at once, then 1, 2, 4 .. 30."""
    return 0.0 if restart <= 1 else min(MAX_BACKOFF, 2.0 ** (restart - 2))


class Supervisor:
    def __init__(self, tree: ProcessTree, units: list[Unit], children_of: Callable[[Unit], list[Child]],
                 events: ReplicaEvents, limit: int, startup_timeout: float, interval: float = 0.2):
        self.tree, self.units, self.children_of, self.events = tree, units, children_of, events
        self.limit, self.startup_timeout, self.interval = limit, startup_timeout, interval
        self.unit_of = {name: u for u in units for name in u.names}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="replica-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_GRACE + 10)
            if self._thread.is_alive():
                log.warning("the replica supervisor is still stopping a replica's ranks; the server stops them too")

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.step():
                    return
        except Exception as e:  # a bug here must end the server, not leave it unwatched
            log.exception("the replica supervisor failed")
            self.events.failed(f"the replica supervisor failed: {e!r}")

    def step(self) -> bool:
        """One round: start-up reports, deaths, due restarts. False once the grid has failed."""
        report = self.tree.poll_ready(int(self.interval * 1000))
        if report is not None:
            self._on_report(report)
        for name in self.tree.dead_children():
            if name not in self.tree.procs:  # stopped already, with the rest of its unit
                continue
            unit = self.unit_of.get(name)
            if unit is None:
                self.events.failed(self.tree.death_report())
                return False
            self._lost(unit, self.tree.death_report(unit.names))
        now = time.monotonic()
        for unit in self.units:
            if unit.state == "starting" and now > unit.deadline:
                self._lost(unit, f"it did not start within {self.startup_timeout:.0f} s")
            elif unit.state == "waiting" and now >= unit.start_at:
                self._start(unit)
            elif unit.state == "serving" and unit.restarts and now - unit.since > RESET_AFTER:
                unit.restarts = 0
        if all(u.state == "down" for u in self.units):
            self.events.failed("every replica is down and will not be started again (--replica-restart-limit "
                               f"{self.limit})")
            return False
        return True

    def _on_report(self, msg: Ready | Failed) -> None:
        unit = self.unit_of.get(msg.name)
        if unit is None or unit.state != "starting":
            return
        if isinstance(msg, Failed):
            self._lost(unit, str(failure(msg.name, msg.error)))
            return
        unit.pending.discard(msg.name)
        if not unit.pending:
            unit.state, unit.since = "serving", time.monotonic()
            log.info("%s %s serving again (restart %d)", unit.label, "is" if len(unit.replicas) == 1 else "are",
                     unit.total_restarts)
            self.events.up(unit.replicas, unit.total_restarts)

    def _lost(self, unit: Unit, reason: str) -> None:
        """The unit died (serving) or failed to start: stop what is left of it; start it again
        after a backoff, or give up."""
        if unit.state == "serving":  # first: no request is placed on it while its ranks stop
            self.events.down(unit.replicas, reason)
        self.tree.stop_children(unit.names, STOP_GRACE)
        if unit.restarts >= self.limit:
            unit.state = "down"
            log.error("%s: %s; %s stay%s down (started again %d time%s in a row, --replica-restart-limit %d)",
                      unit.label, reason, unit.them, "s" if unit.them == "it" else "", unit.restarts,
                      "" if unit.restarts == 1 else "s", self.limit)
            self.events.gave_up(unit.replicas, reason)
            return
        unit.restarts += 1
        delay = backoff(unit.restarts)
        unit.state, unit.start_at = "waiting", time.monotonic() + delay
        log.error("%s: %s; starting %s again in %.0f s (restart %d of at most %d in a row)", unit.label, reason,
                  unit.them, delay, unit.restarts, self.limit)

    def _start(self, unit: Unit) -> None:
        try:
            children = self.children_of(unit)  # on Ray, lost actors are started again here
            self.tree.start(children)
        except OSError as e:
            self._lost(unit, f"its processes could not be started: {e}")
            return
        unit.total_restarts += 1
        unit.state, unit.pending = "starting", {c.name for c in children}
        unit.deadline = time.monotonic() + self.startup_timeout


def units_of(replica_names: list[list[str]], lockstep: bool) -> list[Unit]:
    """One unit per replica (the names of its scheduler ranks), or one for all under lockstep."""
    if lockstep:
        return [Unit(tuple(range(len(replica_names))), [n for names in replica_names for n in names])]
    return [Unit((d,), names) for d, names in enumerate(replica_names)]

