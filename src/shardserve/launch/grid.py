"""Node 0's launch of the rank grid, shared by the server and the offline API.

`LocalGrid` starts this machine's scheduler ranks (and any other workers, such as the server's
tokenizers), and with several machines first admits the other nodes (launch/nodes.py), then
watches both: a dead local child or a lost node is reported once, naming what was lost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from shardserve.config import EngineConfig
from shardserve.distributed.layout import Layout
from shardserve.ipc.sockets import Endpoints
from shardserve.launch.nodes import NodeServer, NodeSpec, hello, run_worker_node
from shardserve.launch.process_tree import Child, ProcessTree
from shardserve.launch.ranks import scheduler_children
from shardserve.launch.supervisor import ReplicaEvents, Supervisor, Unit, units_of

log = logging.getLogger("shardserve.launch")


def heartbeat_timeout(cfg: EngineConfig) -> float:
    """Silence after which a node counts as lost. Launchers beat every 0.5 s and do little else."""
    return min(5.0, cfg.dist_timeout)


def endpoints(layout: Layout, node: NodeSpec, num_tokenizers: int, torchrun: bool = False,
              placement=None) -> Endpoints:
    """With ranks that are not this launcher's children (other nodes, torchrun's processes) the
    fan-out is TCP on node 0; with ranks Ray placed, every channel they use is TCP; otherwise ipc
    paths."""
    if placement is not None:
        return placement.endpoints(num_tokenizers)
    remote = layout.nnodes > 1 or torchrun
    return Endpoints.create(num_tokenizers, fanout_tcp=node.fanout if remote else "",
                            results_tcp=node.results if remote else "", dp=layout.dp, secret=node.secret)


def place(cfg: EngineConfig, layout: Layout, node: NodeSpec, timeout: float):
    """The ranks' places on a Ray cluster (--distributed-executor-backend ray), else None: the
    ranks are this machine's children (or other nodes' launchers' or torchrun's)."""
    if node.executor != "ray":
        return None
    from shardserve.launch.ray_cluster import RayPlacement  # Ray is an optional extra

    return RayPlacement(cfg, layout, node, timeout)


class LocalGrid:
    """`torchrun=True`: the other ranks are torchrun's processes, so start scheduler-0 alone (it
    joins torch's rendezvous through the inherited environment) and run no node channel. With a
    Ray `placement` every rank starts on its actor's node; `stop` releases the placement."""

    def __init__(self, cfg: EngineConfig, layout: Layout, node: NodeSpec, ep: Endpoints, model_name: str,
                 others: list[Child] = (), torchrun: bool = False, placement=None):
        self.placement = placement
        if torchrun:
            ranks = scheduler_children(cfg, ep, layout, "env://", only=range(1))
        elif placement is not None:
            ranks = scheduler_children(cfg, ep, layout, placement=placement)
        else:
            master = node.rendezvous if layout.nnodes > 1 else ""
            ranks = scheduler_children(cfg, ep, layout, master, node.node_rank)
        self.tree = ProcessTree(ep, ranks + list(others))
        self.cfg, self.ep, self.layout, self.torchrun = cfg, ep, layout, torchrun
        self.supervisor: Supervisor | None = None
        self.nodes = (NodeServer(node, hello(layout, 0, model_name), layout, heartbeat_timeout(cfg))
                      if layout.nnodes > 1 and not torchrun else None)
        self._lock = threading.Lock()
        self._reported = False

    def start(self, timeout: float) -> dict[str, dict]:
        """Admit the other nodes, start this node's workers, wait for them; their Ready infos."""
        if self.nodes is not None:
            self.nodes.admit(timeout)
        log.info("%s", starting_text(self.tree.specs, self.layout))
        self.tree.start()
        return self.tree.wait_ready(timeout)

    def failure(self) -> str | None:
        """Why the grid is broken now, if it is: a lost node before a dead local child."""
        lost = self.nodes.lost if self.nodes is not None else None
        if lost:
            return lost
        if self.tree.dead_child():
            if self.nodes is not None:
                # A local rank dying may be the echo of a lost node: give the heartbeat time to say so.
                lost = self.nodes.wait_lost(self.nodes.timeout_s + 1)
            report = self.tree.death_report()
            return f"{lost}; then {report}" if lost else report
        return None

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """Call `on_failure(reason)` once, from a thread, when a local child dies or a node is lost."""

        def once(reason: str = "") -> None:
            with self._lock:
                if self._reported:
                    return
                self._reported = True
            on_failure(self.failure() or reason)

        self.tree.watch(once)
        if self.nodes is not None:
            self.nodes.watch(once)

    @property
    def restartable(self) -> bool:
        """Whether a replica can be stopped and started alone: several replicas, all this
        launcher's children (one machine, not torchrun's processes)."""
        return self.layout.dp > 1 and self.nodes is None and not self.torchrun

    def supervise(self, events: ReplicaEvents, limit: int, startup_timeout: float) -> None:
        """Instead of `watch`: a dead replica is started again (launch/supervisor.py)."""
        names = [[f"scheduler-{r}" for r in self.layout.replica_ranks(d)] for d in range(self.layout.dp)]
        units = units_of(names, lockstep=self.layout.dp_attention)
        self.supervisor = Supervisor(self.tree, units, self._children_of, events, limit, startup_timeout)
        self.supervisor.start()

    def _children_of(self, unit: Unit) -> list:
        ranks = [int(n.removeprefix("scheduler-")) for n in unit.names]
        return scheduler_children(self.cfg, self.ep, self.layout, only=range(ranks[0], ranks[-1] + 1),
                                  placement=self.placement)

    def stop(self) -> None:
        if self.placement is not None:
            self.placement.closed = True  # a replica being started again asks for no more actors
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.nodes is not None:
            self.nodes.stop()
        self.tree.stop()
        if self.placement is not None:
            self.placement.release()


def starting_text(children: list[Child], layout: Layout) -> str:
    """What is about to start and why it takes a while, e.g. 'starting 2 scheduler ranks (tp 2 x
    pp 1 x dp 1 x cp 1) and 2 other workers (detokenizer, tokenizer-0): ...'."""
    ranks = sum(c.name.startswith("scheduler-") for c in children)
    others = [c.name for c in children if not c.name.startswith("scheduler-")]
    text = (f"starting {ranks} scheduler rank{'s' if ranks != 1 else ''}"
            + (f" (of {layout.world} on {layout.nnodes} nodes; " if layout.nnodes > 1 else " (")
            + f"tp {layout.tp} x pp {layout.pp} x dp {layout.dp} x cp {layout.cp})")
    if others:
        text += f" and {len(others)} other worker{'s' if len(others) > 1 else ''} ({', '.join(others)})"
    return text + ": each rank imports torch, loads the model and on a first start builds C kernels ..."


def run_other_node(cfg: EngineConfig, layout: Layout, node: NodeSpec, model_name: str,
                   startup_timeout: float) -> int:
    """Node k > 0, whatever the command: this node's ranks only (no HTTP, no tokenizers), until
    node 0 stops them. Returns the exit code."""
    ep = endpoints(layout, node, 1)

    def tree() -> ProcessTree:
        return ProcessTree(ep, scheduler_children(cfg, ep, layout, node.rendezvous, node.node_rank))

    return run_worker_node(node, hello(layout, node.node_rank, model_name), tree, startup_timeout,
                           heartbeat_timeout(cfg))
