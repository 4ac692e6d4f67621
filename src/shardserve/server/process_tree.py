"""Start, watch and stop the worker processes (spawn method), shared by serve and offline TP.

Children report Ready or Failed on a ZeroMQ socket; a child that dies without a word is noticed
by polling. Stopping sends SIGTERM, waits, then SIGKILLs: no process outlives the launcher.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from shardserve.config import EngineConfig
from shardserve.ipc.messages import Failed, Ready
from shardserve.ipc.sockets import Endpoints, pull, recv
from shardserve.scheduler.process import RankSpec, scheduler_main

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A child failed to start; the message names it and carries its error."""


@dataclass
class Child:
    name: str
    target: Callable
    args: tuple


def scheduler_children(cfg: EngineConfig, ep: Endpoints) -> list[Child]:
    """One scheduler process per tensor-parallel rank, meeting at a free local port."""
    world = cfg.parallel.tp_size
    master = f"127.0.0.1:{free_port()}" if world > 1 else ""
    return [Child(f"scheduler-{r}", scheduler_main, (cfg, ep, RankSpec(r, world, master))) for r in range(world)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessTree:
    def __init__(self, ep: Endpoints, children: list[Child]):
        self.ep, self.specs = ep, children
        self.ctx = zmq.Context()
        self.ready_sock = pull(self.ctx, ep.ready)  # bound before any child can report
        self.procs: dict[str, mp.Process] = {}
        self._stop_watch = threading.Event()

    def start(self) -> None:
        spawn = mp.get_context("spawn")
        for c in self.specs:
            p = spawn.Process(target=c.target, args=c.args, name=c.name, daemon=False)
            p.start()
            log.info("started %s pid=%d", c.name, p.pid)
            self.procs[c.name] = p

    def wait_ready(self, timeout: float) -> dict[str, dict]:
        """Info from each child's Ready message; raises LaunchError on failure or timeout."""
        infos: dict[str, dict] = {}
        deadline = time.monotonic() + timeout
        while len(infos) < len(self.procs):
            self._take(recv(self.ready_sock, timeout_ms=200), infos)
            dead = self.dead_child()
            if dead and dead not in infos:
                # Its Failed message may still be in flight: it says more than an exit code.
                self._take(recv(self.ready_sock, timeout_ms=1000), infos)
                raise LaunchError(f"{dead} exited with code {self.procs[dead].exitcode} while starting")
            if time.monotonic() > deadline:
                missing = sorted(set(self.procs) - set(infos))
                raise LaunchError(f"timed out after {timeout:.0f} s waiting for {', '.join(missing)} to start")
        return infos

    @staticmethod
    def _take(msg, infos: dict[str, dict]) -> None:
        if isinstance(msg, Ready):
            infos[msg.name] = msg.info
        elif isinstance(msg, Failed):
            raise LaunchError(f"{msg.name} failed to start:\n{msg.error.rstrip()}")

    def dead_child(self) -> str | None:
        for name, p in self.procs.items():
            if not p.is_alive():
                return name
        return None

    def death_report(self) -> str:
        """Every dead child and how it ended, those killed by a signal (the likely cause) first."""
        dead = [(n, p.exitcode) for n, p in self.procs.items() if not p.is_alive()]
        dead.sort(key=lambda d: (d[1] is None or d[1] >= 0, d[0]))
        return "; ".join(f"{n} was killed by signal {-c}" if c is not None and c < 0 else
                         f"{n} exited unexpectedly with code {c}" for n, c in dead)

    def watch(self, on_death: Callable[[str], None], interval: float = 0.5) -> None:
        """Call `on_death(message)` once, from a thread, when any child exits."""

        def loop() -> None:
            while not self._stop_watch.wait(interval):
                if self.dead_child():
                    on_death(self.death_report())
                    return

        threading.Thread(target=loop, name="child-watchdog", daemon=True).start()

    def stop(self, grace: float = 5.0) -> None:
        self._stop_watch.set()
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                log.warning("%s ignored SIGTERM; killing it", p.name)
                p.kill()
                p.join(2)
        self.ready_sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.ep.root, ignore_errors=True)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values() if p.pid is not None] + [os.getpid()]
