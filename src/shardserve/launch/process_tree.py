"""Start, watch and stop one machine's worker processes (scheduler ranks, tokenizers, detokenizer).

Each child is its own OS process started as a command (`python -m shardserve.launch.worker`),
not a multiprocessing child. Children report Ready or Failed on a ZeroMQ socket; a child that
dies without a word is noticed by polling. Stopping sends SIGTERM, waits, then SIGKILLs, and
children ask Linux for SIGTERM should the launcher die first: no process outlives the launcher.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from shardserve.ipc.messages.lifecycle import Failed, Ready
from shardserve.ipc.sockets import Endpoints, gate_for, pull, recv
from shardserve.launch import LaunchError
from shardserve.launch.worker import PARENT_ENV

log = logging.getLogger("shardserve.launch")
PROGRESS_INTERVAL = 10.0  # seconds between "still waiting" lines while workers start


@dataclass(frozen=True)
class ByName:
    """A child's function named by module and attribute: the launcher need not import the module
    (the engine, transformers), only the child does, when it calls it."""

    module: str
    name: str

    def __call__(self, *args):
        import importlib

        return getattr(importlib.import_module(self.module), self.name)(*args)


@dataclass
class Child:
    """A process to start: `target(*args)` runs in it (target importable by name, args picklable)."""

    name: str
    target: Callable
    args: tuple
    env: dict[str, str] | None = None  # extra environment (e.g. thread counts)
    role: str = ""  # where it sits, for reports, e.g. "pipeline stage 1 of 2"
    # Starts it elsewhere (a rank Ray placed: launch/ray_cluster.py): (name, pickled (target, args),
    # env) -> a handle like subprocess.Popen's. None: a child of this process.
    spawn: Callable | None = None


# A child refusing a setting raises one of these with a message that names the flag: the user
# needs that line, not the traceback under it (which --log-level debug still shows).
SETTING_ERRORS = ("ValueError", "LayoutError", "FileNotFoundError", "KernelUnavailable")


def failure(name: str, error: str) -> LaunchError:
    """A child's Failed report as a LaunchError: one line for a refused setting, else the whole
    traceback (a fault the user cannot fix by changing a flag)."""
    lines = error.rstrip().splitlines()
    # The last exception's text follows the last indented line (a frame's source or its marker).
    last = max((i for i, line in enumerate(lines) if line.startswith(" ")), default=-1)
    kind, _, message = " ".join(lines[last + 1:]).partition(": ")
    if kind.rsplit(".", 1)[-1] in SETTING_ERRORS and message:
        log.debug("%s failed to start:\n%s", name, error.rstrip())
        return LaunchError(f"{name} failed to start: {message}", exit_code=2)
    return LaunchError(f"{name} failed to start:\n{error.rstrip()}")


class ProcessTree:
    def __init__(self, ep: Endpoints, children: list[Child]):
        self.ep, self.specs = ep, children
        self.ctx = zmq.Context()
        self.gate = gate_for(self.ctx, ep.secret, ep.ready)  # TCP when ranks report from other machines
        self.ready_sock = pull(self.ctx, ep.ready, ep.secret, self.gate, "the ready channel")  # before any child starts
        self.procs: dict[str, subprocess.Popen] = {}
        self.unreaped: list[tuple[str, subprocess.Popen]] = []  # SIGKILLed, not gone yet (see stop_children)
        self._stop_watch = threading.Event()

    def start(self, children: list[Child] | None = None) -> None:
        """Start every child, or `children` (new specs replacing those of the same names: a
        replica started again)."""
        if children is not None:
            fresh = {c.name: c for c in children}
            self.specs = [fresh.pop(c.name, c) for c in self.specs] + list(fresh.values())
        for c in children if children is not None else self.specs:
            payload = pickle.dumps((c.target, c.args))
            if c.spawn is not None:
                p = c.spawn(c.name, payload, c.env or {})
                log.info("started %s pid=%d (%s)", c.name, p.pid, getattr(p, "who", "elsewhere"))
            else:
                env = {**os.environ, **(c.env or {}), PARENT_ENV: str(os.getpid())}
                p = subprocess.Popen([sys.executable, "-m", "shardserve.launch.worker", c.name],
                                     stdin=subprocess.PIPE, env=env)
                p.stdin.write(payload)
                p.stdin.close()
                log.info("started %s pid=%d", c.name, p.pid)
            self.procs[c.name] = p

    def wait_ready(self, timeout: float) -> dict[str, dict]:
        """Info from each child's Ready message; raises LaunchError on failure or timeout."""
        infos: dict[str, dict] = {}
        start = time.monotonic()
        deadline, note = start + timeout, start + PROGRESS_INTERVAL
        while len(infos) < len(self.procs):
            self._take(recv(self.ready_sock, timeout_ms=200, where="the ready channel"), infos)
            if time.monotonic() > note:  # a first start can take a minute: say it is not stuck
                note += PROGRESS_INTERVAL
                waiting = ", ".join(sorted(set(self.procs) - set(infos)))
                log.info("waiting for %s to start (%.0f s so far) ...", waiting, time.monotonic() - start)
            dead = self.dead_child()
            if dead and dead not in infos:
                # Its Failed message may still be in flight: it says more than an exit code.
                self._take(recv(self.ready_sock, timeout_ms=1000, where="the ready channel"), infos)
                raise LaunchError(f"{self.death_report([dead])} while starting")
            if time.monotonic() > deadline:
                missing = sorted(set(self.procs) - set(infos))
                raise LaunchError(f"timed out after {timeout:.0f} s waiting for {', '.join(missing)} to start")
        return infos

    @staticmethod
    def _take(msg, infos: dict[str, dict]) -> None:
        if isinstance(msg, Ready):
            infos[msg.name] = msg.info
        elif isinstance(msg, Failed):
            raise failure(msg.name, msg.error)

    def dead_child(self) -> str | None:
        dead = self.dead_children()
        return dead[0] if dead else None

    def dead_children(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def poll_ready(self, timeout_ms: int) -> Ready | Failed | None:
        """One start-up report (Ready or Failed) if one comes within `timeout_ms`."""
        msg = recv(self.ready_sock, timeout_ms=timeout_ms, where="the ready channel")
        return msg if isinstance(msg, Ready | Failed) else None

    def death_report(self, names: list[str] | None = None) -> str:
        """Every dead child (of `names`, if given) and how it ended, those killed by a signal (the
        likely cause) first."""
        roles = {c.name: f"{c.name} ({c.role})" for c in self.specs if c.role}
        dead = [(roles.get(n, n), p.returncode, getattr(p, "ended", "")) for n, p in self.procs.items()
                if p.poll() is not None and (names is None or n in names)]
        dead.sort(key=lambda d: (d[1] >= 0, d[0]))
        # A rank whose Ray actor (or node) is gone says so in Ray's words (launch/ray_host.py).
        return "; ".join(e or (f"{n} was killed by signal {-c}" if c < 0 else f"{n} exited unexpectedly with code {c}")
                         for n, c, e in dead)

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
        self.stop_children(list(self.procs), grace)
        self._reap()
        self.ready_sock.close(linger=0)
        if self.gate is not None:
            self.gate.stop()
        self.ctx.term()
        shutil.rmtree(self.ep.root, ignore_errors=True)

    def stop_children(self, names: list[str], grace: float = 5.0) -> None:
        """SIGTERM `names`, SIGKILL any still there after `grace` s, and forget them (dead
        children are no longer reported by `dead_children`)."""
        procs = {n: self.procs[n] for n in names if n in self.procs}
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace
        for name, p in procs.items():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s ignored SIGTERM; killing it", name)
                p.kill()
                try:
                    p.wait(2)
                except subprocess.TimeoutExpired:
                    # Still tearing down (a device's memory, say): the others go on; stop() reaps it.
                    log.warning("%s (pid %d) is still exiting after SIGKILL", name, p.pid)
                    self.unreaped.append((name, p))
        for name in procs:
            self.procs.pop(name, None)

    def _reap(self, timeout: float = 10.0) -> None:
        """Wait for the SIGKILLed children stop_children could not wait for; name any left."""
        deadline = time.monotonic() + timeout
        for name, p in self.unreaped:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("%s (pid %d) has not exited %.0f s after SIGKILL", name, p.pid, timeout)
        self.unreaped = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()] + [os.getpid()]
