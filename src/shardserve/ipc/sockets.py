"""ZeroMQ plumbing shared by every process: addresses, sockets, and dying with the parent."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import tempfile
from dataclasses import dataclass, field

import zmq

from shardserve.ipc.messages import Msg, decode_or_none, encode


@dataclass(frozen=True)
class Endpoints:
    """ipc:// addresses in a fresh per-server temp dir, so two servers never collide. The message
    fan-out to the other ranks is TCP instead when ranks live on several machines.

    `scheduler` is where tokenizers send prompts: replica 0's leader itself, or with `dp`
    replicas the router, which forwards each to one leader's `leader(d)` address. Each replica
    has its own plan feed, results inbox and (for the router) cache-event feed; on TCP (ranks on
    several machines) there is one of each, so one replica only."""

    root: str
    num_tokenizers: int
    fanout_tcp: str = ""  # tcp://host:port on node 0, reachable from every node
    results_tcp: str = ""  # likewise: later pipeline stages -> the leader
    dp: int = 1
    # The deployment secret that keys the TCP channels (ipc/secure.py); never printed.
    secret: bytes = field(default=b"", repr=False)

    @classmethod
    def create(cls, num_tokenizers: int, fanout_tcp: str = "", results_tcp: str = "", dp: int = 1,
               secret: bytes = b"") -> Endpoints:
        # mkdtemp makes the directory mode 0700: only this user can reach the ipc sockets in it.
        return cls(tempfile.mkdtemp(prefix="shardserve-"), num_tokenizers, fanout_tcp, results_tcp, dp, secret)

    def _addr(self, name: str) -> str:
        return f"ipc://{os.path.join(self.root, name)}"

    @property
    def api(self) -> str:
        return self._addr("api")

    @property
    def scheduler(self) -> str:
        return self._addr("scheduler")

    @property
    def detokenizer(self) -> str:
        return self._addr("detokenizer")

    def leader(self, replica: int) -> str:
        """Where replica `replica`'s leader takes requests."""
        return self.scheduler if self.dp == 1 else self._addr(f"leader-{replica}")

    def fanout(self, replica: int) -> str:
        return self._tcp(self.fanout_tcp, replica) or self._addr(f"fanout-{replica}")

    def results(self, replica: int) -> str:
        return self._tcp(self.results_tcp, replica) or self._addr(f"results-{replica}")

    def _tcp(self, addr: str, replica: int) -> str:
        # One TCP port each: several replicas across machines would need a port per replica.
        if addr and self.dp > 1:
            raise ValueError(f"replica {replica}: TCP plan feeds serve one replica only (dp {self.dp})")
        return addr

    def events(self, replica: int) -> str:
        """The leader's cache events and finished requests, for the router (dp > 1 only)."""
        return self._addr(f"events-{replica}")

    @property
    def ready(self) -> str:
        return self._addr("ready")

    def tokenizer(self, i: int) -> str:
        return self._addr(f"tokenizer-{i}")


def bind_address(addr: str) -> str:
    """ZeroMQ binds TCP to an IP, not a host name: resolve `tcp://name:port` first."""
    if not addr.startswith("tcp://"):
        return addr
    host, _, port = addr[len("tcp://"):].rpartition(":")
    return f"tcp://{socket.gethostbyname(host)}:{port}"


def listen_socket(host: str, port: int) -> socket.socket:
    """An HTTP port bound now (the server before it starts workers, the router before it serves),
    so a busy port fails in a second; OSError naming host and port if it cannot be had."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def pull(ctx: zmq.Context, addr: str) -> zmq.Socket:
    s = ctx.socket(zmq.PULL)
    s.bind(addr)
    return s


def push(ctx: zmq.Context, addr: str) -> zmq.Socket:
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 1000)
    s.connect(addr)
    return s


def send(sock: zmq.Socket, msg: Msg) -> None:
    sock.send(encode(msg), copy=False)


def _name(sock: zmq.Socket) -> str:
    """The socket's address, to name it in a log line."""
    try:
        return sock.getsockopt_string(zmq.LAST_ENDPOINT) or "a socket"
    except zmq.ZMQError:
        return "a socket"


def recv(sock: zmq.Socket, timeout_ms: int | None = None, where: str = "") -> Msg | None:
    """One message, or None if none arrived within `timeout_ms` (None blocks until a valid one).
    A malformed message is logged (naming `where`, else the socket's address) and dropped: with a
    timeout it reads as None, so callers that poll go on polling."""
    while True:
        if timeout_ms is not None and not sock.poll(timeout_ms):
            return None
        msg = decode_or_none(sock.recv(), where or _name(sock))
        if msg is not None or timeout_ms is not None:
            return msg


def recv_all(sock: zmq.Socket, where: str = "") -> list[Msg]:
    """Every message waiting. Malformed ones are logged (naming `where`, else the socket's
    address) and dropped instead of raising."""
    out = []
    while True:
        try:
            data = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return out
        msg = decode_or_none(data, where or _name(sock))
        if msg is not None:
            out.append(msg)


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies, so no worker is orphaned."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
