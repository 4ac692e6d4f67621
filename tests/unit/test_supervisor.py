"""The replica supervisor's decisions, on a process tree that only records: a restart whose
start fails is retried with backoff, the limit leaves a replica down, the last one down fails
the grid, and a death outside every replica fails it at once."""

from __future__ import annotations

from shardserve.ipc.messages.lifecycle import Failed, Ready
from shardserve.launch import supervisor
from shardserve.launch.process_tree import Child
from shardserve.launch.supervisor import Supervisor, backoff, units_of


class Tree:
    """The parts of ProcessTree the supervisor uses: reports and deaths are queued by the test."""

    def __init__(self, names: list[str]):
        self.procs = {n: object() for n in names}
        self.reports: list[Ready | Failed] = []
        self.dead: list[str] = []
        self.started: list[list[str]] = []
        self.stopped: list[list[str]] = []

    def poll_ready(self, timeout_ms: int):
        return self.reports.pop(0) if self.reports else None

    def dead_children(self) -> list[str]:
        dead, self.dead = self.dead, []
        self.last_dead = dead
        return dead

    def death_report(self, names=None) -> str:
        """The real one names the dead among `names` (or among all)."""
        return f"{[n for n in self.last_dead if names is None or n in names][0]} died"

    def stop_children(self, names, grace) -> None:
        self.stopped.append(list(names))
        for n in names:
            self.procs.pop(n, None)

    def start(self, children: list[Child]) -> None:
        self.started.append([c.name for c in children])
        self.procs.update({c.name: object() for c in children})


class Events:
    def __init__(self):
        self.seen: list[tuple] = []

    def down(self, replicas, reason):
        self.seen.append(("down", replicas, reason))

    def up(self, replicas, restarts):
        self.seen.append(("up", replicas, restarts))

    def gave_up(self, replicas, reason):
        self.seen.append(("gave_up", replicas, reason))

    def failed(self, reason):
        self.seen.append(("failed", reason))


def grid(limit: int = 2):
    tree, events = Tree(["tokenizer", "scheduler-0", "scheduler-1"]), Events()
    units = units_of([["scheduler-0"], ["scheduler-1"]], lockstep=False)
    sup = Supervisor(tree, units, lambda u: [Child(n, print, ()) for n in u.names], events, limit,
                     startup_timeout=60, interval=0.0)
    return tree, events, sup, units


def test_a_restart_whose_start_fails_is_tried_again_then_serves(monkeypatch):
    monkeypatch.setattr(supervisor, "backoff", lambda restart: 0.0)
    tree, events, sup, units = grid(limit=3)
    tree.dead.append("scheduler-1")
    assert sup.step()  # down, and (backoff 0) started again in the same round
    assert events.seen == [("down", (1,), "scheduler-1 died")] and tree.started == [["scheduler-1"]]
    tree.reports.append(Failed(name="scheduler-1", error="Traceback ...\nRuntimeError: out of memory"))
    assert sup.step()
    assert units[1].state == "starting" and units[1].restarts == 2 and tree.started[-1] == ["scheduler-1"]
    assert ("up", (1,), 1) not in events.seen and len([e for e in events.seen if e[0] == "down"]) == 1
    tree.reports.append(Ready(name="scheduler-1"))
    assert sup.step()
    assert events.seen[-1] == ("up", (1,), 2) and units[1].state == "serving" and units[0].state == "serving"


def test_failed_starts_reach_the_limit_then_the_last_replica_down_fails_the_grid(monkeypatch):
    monkeypatch.setattr(supervisor, "backoff", lambda restart: 0.0)
    tree, events, sup, units = grid(limit=1)
    tree.dead.append("scheduler-0")
    assert sup.step()
    tree.reports.append(Failed(name="scheduler-0", error="ValueError: bad"))
    assert sup.step()
    assert units[0].state == "down" and events.seen[-1][0] == "gave_up" and "bad" in events.seen[-1][2]
    assert units[1].state == "serving"  # the other replica never paused
    tree.dead.append("scheduler-1")
    assert sup.step()  # replica 1 is started again: one replica is still coming back
    tree.dead.append("scheduler-1")
    assert not sup.step()
    assert events.seen[-1][0] == "failed" and "every replica is down" in events.seen[-1][1]


def test_a_start_past_its_deadline_counts_as_a_failed_start(monkeypatch):
    monkeypatch.setattr(supervisor, "backoff", lambda restart: 0.0)
    tree, events, sup, units = grid(limit=1)
    tree.dead.append("scheduler-0")
    assert sup.step()
    units[0].deadline = 0.0  # as if startup_timeout had passed
    assert sup.step()
    assert units[0].state == "down" and "did not start within 60 s" in events.seen[-1][2]


def test_a_death_outside_every_replica_fails_the_grid_at_once():
    tree, events, sup, _ = grid()
    tree.dead.append("tokenizer")
    assert not sup.step() and events.seen == [("failed", "tokenizer died")] and tree.started == []


def test_backoff_grows_to_its_cap():
    assert [backoff(r) for r in (1, 2, 3, 4, 5, 10)] == [0.0, 1.0, 2.0, 4.0, 8.0, supervisor.MAX_BACKOFF]


def test_processes_that_cannot_be_started_count_as_a_failed_start(monkeypatch):
    monkeypatch.setattr(supervisor, "backoff", lambda restart: 0.0)
    tree, events, sup, units = grid(limit=1)

    def cannot(children):
        raise OSError("Resource temporarily unavailable")

    tree.start = cannot
    tree.dead.append("scheduler-0")
    assert sup.step()
    assert units[0].state == "down" and "could not be started: Resource temporarily unavailable" in events.seen[-1][2]


def test_a_replica_serving_long_enough_has_its_restarts_forgiven(monkeypatch):
    monkeypatch.setattr(supervisor, "backoff", lambda restart: 0.0)
    tree, events, sup, units = grid(limit=1)
    tree.dead.append("scheduler-0")
    assert sup.step()
    tree.reports.append(Ready(name="scheduler-0"))
    assert sup.step() and units[0].restarts == 1
    units[0].since -= supervisor.RESET_AFTER + 1  # as if it had served that long
    assert sup.step() and units[0].restarts == 0
    tree.dead.append("scheduler-0")  # so a death now is started again, not the limit
    assert sup.step() and units[0].state == "starting" and units[0].total_restarts == 2
