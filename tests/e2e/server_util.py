"""Start a real `shardserve serve` subprocess for a test and prove it leaves nothing behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx


def unfinished(events: list[str]) -> bool:
    """Whether a stream's events so far carry tokens and no finish: the request is still running."""
    chunks = [json.loads(e[len("data: "):]) for e in events if e.startswith("data: {")]
    texts = [c for c in chunks if c.get("choices")]
    return bool(texts) and "data: [DONE]" not in events and all(
        ch.get("finish_reason") is None for c in texts for ch in c["choices"])


_PORT_LOCK = threading.Lock()
_PORT_STRIDE = 4  # a server's derived ports: --port + 1 (disaggregation bootstrap), + tensor rank
_port_next = [0]


def _port_range() -> tuple[int, int]:
    """Ports this run hands out: below the kernel's ephemeral range, which bind(0) draws from."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return 10000, max(low, 10000 + 1000 * _PORT_STRIDE)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free port whose next three are free too, handed out once per run.

    Taken from below the ephemeral range, so no process's bind to port 0 (a launcher's master
    port, a ZeroMQ socket) can take it between this check and the server's own bind, and in
    blocks so that one server's --port + 1 is never another's --port.
    """
    lo, hi = _port_range()
    with _PORT_LOCK:
        if not _port_next[0]:
            span = (hi - lo) // _PORT_STRIDE
            _port_next[0] = lo + (os.getpid() * 7919 % span) * _PORT_STRIDE
        for _ in range((hi - lo) // _PORT_STRIDE):
            base = _port_next[0]
            _port_next[0] = base + _PORT_STRIDE if base + 2 * _PORT_STRIDE <= hi else lo
            if all(_bindable(base + i) for i in range(_PORT_STRIDE)):
                return base
    raise RuntimeError(f"no free block of {_PORT_STRIDE} ports in {lo}-{hi}")


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Server:
    def __init__(self, *args: str, log_path: str, timeout: float = 180, host: str | None = None):
        """`host`: --host to listen on (reached at that address; a wildcard at 127.0.0.1)."""
        self.port = free_port()
        reach = host if host and host not in ("0.0.0.0", "::") else "127.0.0.1"
        self.url = f"http://{reach}:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "shardserve", "serve", "--port", str(self.port), *args]
        if host:
            cmd += ["--host", host]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.read_log()}")

    def read_log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def child_pid(self, name: str) -> int:
        m = re.search(rf"started {re.escape(name)} pid=(\d+)", self.read_log())
        assert m, f"no pid logged for {name}"
        return int(m.group(1))

    def last_pid(self, name: str) -> int:
        """The pid of `name`'s latest start (a replica started again logs its ranks again)."""
        pids = re.findall(rf"started {re.escape(name)} pid=(\d+)", self.read_log())
        assert pids, f"no pid logged for {name}"
        return int(pids[-1])

    def wait_replica(self, replica: int, state: str, restarts: int | None = None, timeout: float = 120) -> dict:
        """Until /health shows `replica` in `state` (and started again `restarts` times); the body."""
        deadline = time.monotonic() + timeout
        while True:
            body = httpx.get(self.url + "/health", timeout=5).json()
            r = body["replicas"][replica]
            if r["state"] == state and (restarts is None or r["restarts"] == restarts):
                return body
            assert time.monotonic() < deadline, f"replica {replica} never reached {state}: {body}"
            time.sleep(0.2)

    def kill_mid_request(self, child: str, timeout: float = 30) -> float:
        """Start a long streamed completion, SIGKILL `child` once its tokens flow (checked: it is
        then running, not finished), and wait for the server to exit; returns how long that took.
        The stream must have ended, in an error. (With --dp-size, a dead replica is started again
        instead: test_replica_restart.py.)"""
        stream = LongStream(self.url, max_tokens=400)
        stream.wait_running()
        os.kill(self.child_pid(child), signal.SIGKILL)
        start = time.monotonic()
        self.proc.wait(timeout)
        waited = time.monotonic() - start
        stream.assert_failed(timeout)
        return waited

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> tuple[int, list[int]]:
        """Signal the server; return its exit code and any process that survived it."""
        kids = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(p) for p in kids):
            time.sleep(0.1)
        left = [p for p in kids if alive(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
        self.log.close()
        return code, left


class LongStream:
    """A long streamed completion (ignore_eos) on a thread, its events kept as they come: a test
    acts on a request it has seen running, and checks how it ended."""

    def __init__(self, url: str, max_tokens: int, timeout: float = 60, prompt: list[int] | None = None):
        self.events: list[str] = []
        self.error: str | None = None
        self._flowing = threading.Event()
        body = {"prompt": prompt or [5, 6], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(url, body, timeout), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict, timeout: float) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
                for line in r.iter_lines():
                    if line:
                        self.events.append(line)
                        self._flowing.set()
        except httpx.HTTPError as e:
            self.error = repr(e)
        self._flowing.set()

    def wait_running(self, timeout: float = 60) -> None:
        """Until tokens flow; then the request must be running, not finished."""
        assert self._flowing.wait(timeout), "the long request never streamed"
        assert unfinished(list(self.events)), (self.error, self.events[-3:])

    def ended_in_error(self, timeout: float = 30) -> bool:
        """Once the stream has ended (within `timeout`, else an assertion fails): whether in an
        error, as opposed to finishing its tokens (one of the two, never both nor neither)."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the request was still open after the server exited"
        errored = self.error is not None or any('"error"' in e for e in self.events)
        finished = '"finish_reason":"length"' in "".join(self.events).replace(" ", "")
        assert errored != finished, self.events[-3:]
        return errored

    def assert_failed(self, timeout: float = 30) -> None:
        """The stream ended (within `timeout`) in an error, not by finishing its tokens."""
        assert self.ended_in_error(timeout), self.events[-3:]


@contextlib.contextmanager
def scripted_server(tmp_path_factory, *flags: str) -> Iterator[Server]:
    """A live server on the scripted model (scripted_model.py: it always answers "<think>Rome?</think>Paris.")
    with --reasoning-parser qwen3 and these flags; on exit, it must stop cleanly and leave no process."""
    from scripted_model import save_scripted_model

    path = str(tmp_path_factory.mktemp("scripted"))
    save_scripted_model(path)
    server = Server("--model", path, "--reasoning-parser", "qwen3", "--num-pages", "256", "--page-size", "16",
                    *flags, log_path=str(tmp_path_factory.mktemp("logs") / "server.log"))
    try:
        yield server
    finally:
        code, left = server.stop()
    assert left == [] and code == 0, server.read_log()[-3000:]
