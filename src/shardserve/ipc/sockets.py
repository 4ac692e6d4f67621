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
from shardserve.ipc.secure import Gate, connect_secure, serve_secure


@dataclass(frozen=True)
class TcpHosts:
    """Where every channel a rank on another machine touches listens, when Ray places ranks
    (launch/ray_cluster.py): `head` is "ip:port" on the API process's machine (its inbox, the
    detokenizer, the ready channel at port, +1, +2); `leaders[d]` is "ip:port" on replica d's
    leader's machine (its inbox, plan feed, results inbox and cache events at port .. +3)."""

    head: str
    leaders: tuple[str, ...]


def _tcp_at(base: str, offset: int) -> str:
    host, _, port = base.rpartition(":")
    return f"tcp://{host}:{int(port) + offset}"


@dataclass(frozen=True)
class Endpoints:
    """ipc:// addresses in a fresh per-server temp dir, so two servers never collide. The message
    fan-out to the other ranks is TCP instead when ranks live on several machines; with `hosts`
    (ranks placed by Ray) every channel a rank uses is TCP.

    `scheduler` is where tokenizers send prompts: replica 0's leader itself, or with `dp`
    replicas the router, which forwards each to one leader's `leader(d)` address. Each replica
    has its own plan feed, results inbox and (for the router) cache-event feed; on TCP from
    `--nnodes` (ranks on several machines) there is one of each, so one replica only."""

    root: str
    num_tokenizers: int
    fanout_tcp: str = ""  # tcp://host:port on node 0, reachable from every node
    results_tcp: str = ""  # likewise: later pipeline stages -> the leader
    dp: int = 1
    # The deployment secret that keys the TCP channels (ipc/secure.py); never printed.
    secret: bytes = field(default=b"", repr=False)
    hosts: TcpHosts | None = None

    @classmethod
    def create(cls, num_tokenizers: int, fanout_tcp: str = "", results_tcp: str = "", dp: int = 1,
               secret: bytes = b"", hosts: TcpHosts | None = None) -> Endpoints:
        # mkdtemp makes the directory mode 0700: only this user can reach the ipc sockets in it.
        return cls(tempfile.mkdtemp(prefix="shardserve-"), num_tokenizers, fanout_tcp, results_tcp, dp, secret,
                   hosts)

    def _addr(self, name: str) -> str:
        return f"ipc://{os.path.join(self.root, name)}"

    def _head(self, name: str, offset: int) -> str:
        return _tcp_at(self.hosts.head, offset) if self.hosts else self._addr(name)

    def _replica(self, name: str, replica: int, offset: int) -> str:
        return _tcp_at(self.hosts.leaders[replica], offset) if self.hosts else self._addr(f"{name}-{replica}")

    @property
    def api(self) -> str:
        return self._head("api", 0)

    @property
    def scheduler(self) -> str:
        return self.leader(0) if self.dp == 1 else self._addr("scheduler")

    @property
    def detokenizer(self) -> str:
        return self._head("detokenizer", 1)

    def leader(self, replica: int) -> str:
        """Where replica `replica`'s leader takes requests."""
        if self.hosts:
            return self._replica("leader", replica, 0)
        return self._addr("scheduler") if self.dp == 1 else self._addr(f"leader-{replica}")

    def fanout(self, replica: int) -> str:
        return self._tcp(self.fanout_tcp, replica) or self._replica("fanout", replica, 1)

    def results(self, replica: int) -> str:
        return self._tcp(self.results_tcp, replica) or self._replica("results", replica, 2)

    def _tcp(self, addr: str, replica: int) -> str:
        # One TCP port each: several replicas across machines would need a port per replica.
        if addr and self.dp > 1:
            raise ValueError(f"replica {replica}: TCP plan feeds serve one replica only (dp {self.dp})")
        return addr

    def events(self, replica: int) -> str:
        """The leader's cache events and finished requests, for the router (dp > 1 only)."""
        return self._replica("events", replica, 3)

    @property
    def ready(self) -> str:
        return self._head("ready", 2)

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


def is_tcp(addr: str) -> bool:
    return addr.startswith("tcp://")


def _need(secret: bytes, addr: str) -> bytes:
    if not secret:
        raise ValueError(f"{addr} is a TCP channel and no deployment secret was given")
    return secret


def gate_for(ctx: zmq.Context, secret: bytes, *addrs: str) -> Gate | None:
    """The ZAP handler a process needs before it binds any of `addrs` on TCP (one per context),
    or None when all are ipc paths."""
    tcp = [a for a in addrs if is_tcp(a)]
    return Gate(ctx, _need(secret, tcp[0])) if tcp else None


def bound(ctx: zmq.Context, kind: int, addr: str, secret: bytes = b"", gate: Gate | None = None,
          channel: str = "") -> zmq.Socket:
    """A socket bound to `addr`: on TCP a CURVE server of this deployment (`gate` logs peers
    that fail the handshake and, by ZAP, admits only the deployment's key)."""
    sock = ctx.socket(kind)
    if is_tcp(addr):
        serve_secure(sock, _need(secret, addr))
        if gate is not None:
            gate.watch(sock, f"{channel or 'a channel'} ({addr})")
    try:
        sock.bind(bind_address(addr))
    except zmq.ZMQError as e:  # a port taken: one line naming it, not a traceback
        sock.close(linger=0)
        raise ValueError(f"{channel or 'a channel'} cannot listen on {addr}: {e.strerror}") from None
    return sock


def connected(ctx: zmq.Context, kind: int, addr: str | list[str], secret: bytes = b"",
              opts: dict[int, int] | None = None) -> zmq.Socket:
    """A socket connected to `addr` (or each of a list), on TCP as a CURVE client of this
    deployment; `opts` are set before connecting (a high-water mark binds each pipe as it opens)."""
    addrs = [addr] if isinstance(addr, str) else addr
    sock = ctx.socket(kind)
    for opt, value in (opts or {}).items():
        sock.setsockopt(opt, value)
    if any(is_tcp(a) for a in addrs):
        connect_secure(sock, _need(secret, addrs[0]))
    for a in addrs:
        sock.connect(a)
    return sock


def pull(ctx: zmq.Context, addr: str, secret: bytes = b"", gate: Gate | None = None, channel: str = "") -> zmq.Socket:
    return bound(ctx, zmq.PULL, addr, secret, gate, channel)


def push(ctx: zmq.Context, addr: str, secret: bytes = b"") -> zmq.Socket:
    s = connected(ctx, zmq.PUSH, addr, secret)
    s.setsockopt(zmq.LINGER, 1000)
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
