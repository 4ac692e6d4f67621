"""Start `shardserve` commands (servers, the router) for a benchmark, and stop them after.

Each runs on a free port with its output in a log file; a command that exits or stays unhealthy
past the timeout raises with the end of its log. `stop` sends SIGTERM and waits (SIGKILL after
the grace period), so a benchmark leaves no process behind.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from shardserve.ipc.sockets import die_with_parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def environ(**values: str) -> Iterator[None]:
    """Set environment variables for the processes started inside (thread counts, the secret)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Spawned:
    def __init__(self, command: str, args: list[str], name: str, timeout: float = 600.0):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(tempfile.mkdtemp(prefix="shardserve-bench-"), f"{name}.log")
        self.log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "shardserve", command, *args, "--port", str(self.port)]
        print(f"[bench] starting {name}: shardserve {command} {shlex.join(args)}", file=sys.stderr, flush=True)
        # Its own process group (stopped whole below), and SIGTERM should the benchmark die first.
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=die_with_parent)
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"shardserve bench: the {self.name} exited with {self.proc.returncode} before it was "
                                 f"healthy: {self.last_line()} (its log: {self.log_path})")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise SystemExit(f"shardserve bench: the {self.name} was not healthy within {timeout:.0f} s: "
                         f"{self.last_line()} (its log: {self.log_path})")

    def last_line(self) -> str:
        """What the process said last (its error, where it failed), for a one-line message."""
        lines = [line.strip() for line in self.tail().splitlines() if line.strip()]
        return lines[-1] if lines else "it logged nothing"

    def tail(self, chars: int = 3000) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-chars:]

    def stop(self, grace: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def tree_rss_kb(pid: int) -> dict[int, tuple[int, int]]:
    """Resident memory of `pid` and every process below it, from /proc: pid -> (VmRSS, RssAnon)
    in KiB (anonymous memory is what a leak grows; the rest is mapped files and libraries)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except OSError:
                continue
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/status") as f:
                fields = {k: v for k, _, v in (line.partition(":") for line in f)}
            out[p] = (int(fields.get("VmRSS", "0 kB").split()[0]), int(fields.get("RssAnon", "0 kB").split()[0]))
        except (OSError, ValueError):
            continue
    return out
