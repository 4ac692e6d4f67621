"""Several machines: node 0's launcher admits the others, and every launcher watches the rest.

`--dist-init-addr HOST:PORT` names node 0. Four ports there must be reachable from every node:

    PORT      torch.distributed's rendezvous (rank 0's TCP store)
    PORT + 1  this node channel (a ZeroMQ ROUTER on node 0; each other node a DEALER)
    PORT + 2  scheduler-0's plan feed (PUB), which every other rank subscribes to
    PORT + 3  scheduler-0's results inbox (PULL): later pipeline stages' results and counts

Before any rank starts, each node k > 0 says hello with its flags; node 0 compares them with its
own and refuses a mismatch (another --nnodes, world size or model), which both sides report.
Then the launchers exchange heartbeats: node 0 learns when a node is lost (its launcher killed,
or one of its ranks died, which that launcher reports), node k learns when node 0 is gone or
tells it to stop (Ctrl-C on node 0 stops every node).

Our three channels are CURVE-secured with the deployment secret (ipc/secure.py), which every node
must hold (SHARDSERVE_DIST_SECRET or --dist-secret-file): a process without it cannot join, send
or listen. torch.distributed's own rendezvous and gloo/NCCL connections are torch's and are not.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from shardserve.config import EXECUTORS
from shardserve.distributed.layout import Layout, LayoutError
from shardserve.ipc.messages import decode_or_none, encode
from shardserve.ipc.messages.nodes import NodeBeat, NodeFailed, NodeHello, NodeRefused, NodeStop, NodeWelcome
from shardserve.ipc.secure import SECRET_ENV, Gate, connect_secure, serve_secure
from shardserve.ipc.sockets import bind_address
from shardserve.launch import LaunchError
from shardserve.launch.process_tree import ProcessTree

log = logging.getLogger("shardserve.launch")
BEAT_S = 0.5


@dataclass(frozen=True)
class NodeSpec:
    """This launcher's machine: its index and where node 0 listens."""

    node_rank: int = 0
    dist_init_addr: str = ""  # host:port of node 0; needed with more than one node
    secret: bytes = field(default=b"", repr=False)  # keys the TCP channels; never printed
    executor: str = "local"  # --distributed-executor-backend: local (this machine's children) or ray
    ray_address: str = ""  # --ray-address (else RAY_ADDRESS, else a Ray cluster started here)

    def check(self, layout: Layout) -> None:
        if self.executor not in EXECUTORS:
            raise LayoutError(f"--distributed-executor-backend must be one of {', '.join(EXECUTORS)}, "
                              f"got {self.executor!r}")
        if self.executor == "ray" and layout.nnodes > 1:
            raise LayoutError("--distributed-executor-backend ray places the ranks on the Ray cluster's nodes itself: "
                              "leave out --nnodes/--node-rank/--dist-init-addr")
        if not 0 <= self.node_rank < layout.nnodes:
            raise LayoutError(f"--node-rank {self.node_rank} must be in [0, {layout.nnodes}) for --nnodes "
                              f"{layout.nnodes}")
        if layout.nnodes > 1:
            host, _, port = self.dist_init_addr.rpartition(":")
            last = 3 if layout.pp > 1 else 2  # the results inbox only with pipeline stages
            if not host or not port.isdigit() or not 0 < int(port) <= 65535 - last:
                raise LayoutError(f"--dist-init-addr must be HOST:PORT (node 0's address, PORT to PORT+{last} free) "
                                  f"with --nnodes {layout.nnodes}, got {self.dist_init_addr!r}")
            if not self.secret:
                raise LayoutError(f"--nnodes {layout.nnodes} needs a deployment secret on every node: set "
                                  f"{SECRET_ENV}, or --dist-secret-file PATH (node 0 creates it if missing; copy it "
                                  f"to the other nodes)")

    def _addr(self, offset: int) -> str:
        host, _, port = self.dist_init_addr.rpartition(":")
        return f"{host}:{int(port) + offset}"

    @property
    def rendezvous(self) -> str:
        return self._addr(0)

    @property
    def channel(self) -> str:
        return f"tcp://{self._addr(1)}"

    @property
    def fanout(self) -> str:
        return f"tcp://{self._addr(2)}"

    @property
    def results(self) -> str:
        return f"tcp://{self._addr(3)}"


def ranks_text(layout: Layout, node: int) -> str:
    r = layout.node_ranks(node)
    return f"rank {r.start}" if len(r) == 1 else f"ranks {r.start}-{r.stop - 1}"


def hello(layout: Layout, node_rank: int, model: str) -> NodeHello:
    return NodeHello(node_rank=node_rank, nnodes=layout.nnodes, world=layout.world, layout=repr(layout), model=model)


def _mismatch(mine: NodeHello, theirs: NodeHello) -> str | None:
    for name, flag in (("nnodes", "--nnodes"), ("world", "world size"), ("layout", "layout"), ("model", "model")):
        if getattr(mine, name) != getattr(theirs, name):
            return (f"node {theirs.node_rank} was started with {flag} {getattr(theirs, name)} but node 0 runs "
                    f"{getattr(mine, name)}")
    return None


class NodeServer:
    """Node 0's end of the channel. Not thread-safe: `admit` before `watch`, `stop` after it."""

    def __init__(self, spec: NodeSpec, mine: NodeHello, layout: Layout, timeout_s: float):
        self.mine, self.layout, self.timeout_s = mine, layout, timeout_s
        self.ctx = zmq.Context()
        self.gate = Gate(self.ctx, spec.secret)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 500)
        serve_secure(self.sock, spec.secret)
        self.gate.watch(self.sock, f"the node channel ({spec.channel})")
        try:
            self.sock.bind(bind_address(spec.channel))
        except zmq.ZMQError as e:
            self.gate.stop()
            self.ctx.destroy(linger=0)
            raise LaunchError(f"node 0 cannot listen on {spec.channel} (--dist-init-addr port + 1): {e}") from None
        self.spec = spec
        self.peers: dict[int, bytes] = {}
        self.seen: dict[int, float] = {}
        self.lost: str | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _send(self, ident: bytes, msg) -> None:
        self.sock.send_multipart([ident, encode(msg)])

    def admit(self, timeout: float) -> None:
        """Wait until every other node has said a matching hello; refuse (and raise) on a mismatch."""
        deadline, said = time.monotonic() + timeout, -60.0
        while len(self.peers) < self.layout.nnodes - 1:
            if self.sock.poll(200):
                ident, raw = self.sock.recv_multipart()
                msg = decode_or_none(raw, "the node channel")
                if isinstance(msg, NodeHello):
                    why = _mismatch(self.mine, msg)
                    if why:
                        self._send(ident, NodeRefused(reason=why))
                        raise LaunchError(why)
                    self.peers[msg.node_rank], self.seen[msg.node_rank] = ident, time.monotonic()
                    log.info("node %d joined (%d of %d nodes)", msg.node_rank, len(self.peers) + 1, self.layout.nnodes)
            now = time.monotonic()
            missing = [n for n in range(1, self.layout.nnodes) if n not in self.peers]
            if not missing:
                break
            if now > deadline:
                raise LaunchError(f"node {', '.join(map(str, missing))} did not connect to {self.spec.channel} "
                                  f"within {timeout:.0f} s")
            if now - said > 5:
                said = now
                log.info("waiting for node %s to connect to %s", ", ".join(map(str, missing)), self.spec.channel)
        for ident in self.peers.values():
            self._send(ident, NodeWelcome())

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """From a thread: beat to every node; call `on_lost(reason)` once if one fails or falls silent."""

        start = time.monotonic()  # ranks were starting until now: silence so far does not count
        self.seen = dict.fromkeys(self.seen, start)

        def loop() -> None:
            while not self._done.is_set():
                for ident in self.peers.values():
                    self._send(ident, NodeBeat())
                while self.sock.poll(int(BEAT_S * 1000)):
                    ident, raw = self.sock.recv_multipart()
                    msg = decode_or_none(raw, "the node channel")
                    node = next((n for n, i in self.peers.items() if i == ident), None)
                    if node is not None:
                        self.seen[node] = time.monotonic()
                    if isinstance(msg, NodeFailed):
                        return self._lose(on_lost, f"node {node} failed: {msg.reason}")
                now = time.monotonic()
                for node, last in self.seen.items():
                    if now - last > self.timeout_s:
                        return self._lose(on_lost, f"lost node {node} ({ranks_text(self.layout, node)}): "
                                                   f"no heartbeat from its launcher for {now - last:.1f} s")

        self._thread = threading.Thread(target=loop, name="node-watch", daemon=True)
        self._thread.start()

    def _lose(self, on_lost: Callable[[str], None], reason: str) -> None:
        self.lost = reason
        on_lost(reason)

    def wait_lost(self, seconds: float) -> str | None:
        """A local rank died: give the channel a moment to say whether a lost node caused it."""
        deadline = time.monotonic() + seconds
        while self.lost is None and time.monotonic() < deadline and self._thread and self._thread.is_alive():
            time.sleep(0.05)
        return self.lost

    def stop(self) -> None:
        """Tell every node to stop its ranks, then close."""
        self._done.set()
        if self._thread is not None:
            self._thread.join(2 * BEAT_S + 1)
        for ident in self.peers.values():
            self._send(ident, NodeStop())
        self.sock.close(linger=500)
        self.gate.stop()
        self.ctx.term()


def run_worker_node(spec: NodeSpec, mine: NodeHello, tree_factory: Callable[[], ProcessTree],
                    startup_timeout: float, timeout_s: float) -> int:
    """Node k > 0: join node 0, start this node's ranks, serve until told to stop. Exit code."""
    if threading.current_thread() is threading.main_thread():  # SIGTERM stops the ranks, like Ctrl-C
        signal.signal(signal.SIGTERM, _interrupt)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 500)
    connect_secure(sock, spec.secret)
    sock.connect(spec.channel)
    tree: ProcessTree | None = None
    try:
        sock.send(encode(mine))
        _await_welcome(sock, spec, mine.node_rank, startup_timeout)
        tree = tree_factory()
        tree.start()
        tree.wait_ready(startup_timeout)
        log.info("node %d: ranks ready; serving until node 0 stops", mine.node_rank)
        return _beat_until_stopped(sock, tree, mine.node_rank, timeout_s)
    finally:
        if tree is not None:
            tree.stop()
        sock.close(linger=500)
        ctx.term()


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def _await_welcome(sock: zmq.Socket, spec: NodeSpec, node: int, timeout: float) -> None:
    deadline, said = time.monotonic() + timeout, -60.0
    while not sock.poll(200):
        now = time.monotonic()
        if now > deadline:
            raise LaunchError(f"node {node}: node 0 did not answer at {spec.channel} within {timeout:.0f} s")
        if now - said > 5:
            said = now
            log.info("node %d: waiting for node 0 at %s (--dist-init-addr %s)", node, spec.channel,
                     spec.dist_init_addr)
    msg = decode_or_none(sock.recv(), "the node channel")
    if isinstance(msg, NodeRefused):
        raise LaunchError(f"node 0 refused node {node}: {msg.reason}")
    if not isinstance(msg, NodeWelcome):
        raise LaunchError(f"node {node}: unexpected first message from node 0: {type(msg).__name__}")


def _beat_until_stopped(sock: zmq.Socket, tree: ProcessTree, node: int, timeout_s: float) -> int:
    last_heard = last_beat = time.monotonic()
    while True:
        if sock.poll(int(BEAT_S * 1000)):
            msg = decode_or_none(sock.recv(), "the node channel")
            last_heard = time.monotonic()
            if isinstance(msg, NodeStop):
                log.info("node %d: node 0 stopped; stopping this node's ranks", node)
                return 0
        now = time.monotonic()
        if now - last_beat >= BEAT_S:
            sock.send(encode(NodeBeat()))
            last_beat = now
        if tree.dead_child():
            report = tree.death_report()
            log.error("node %d: %s", node, report)
            sock.send(encode(NodeFailed(reason=report)))
            return 1
        if now - last_heard > timeout_s:
            log.error("node %d: lost node 0: no heartbeat for %.1f s", node, now - last_heard)
            return 1
