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
from shardserve.distributed.expert_placement import PlacementPlan, load_counts
from shardserve.distributed.layout import Layout, LayoutError
from shardserve.ipc.sockets import Endpoints
from shardserve.launch.checks import check_context, check_device, check_kv_budget
from shardserve.launch.nodes import NodeServer, NodeSpec, hello, run_worker_node
from shardserve.launch.process_tree import Child, ProcessTree
from shardserve.launch.ranks import scheduler_children
from shardserve.loader.model_path import Checkpoint
from shardserve.loader.weights import read_model_config

log = logging.getLogger("shardserve.launch")


def check_layout(layout: Layout, node: NodeSpec, ckpt: Checkpoint, cfg: EngineConfig) -> None:
    """Refuse, before any process starts, a grid this machine's flags or the model cannot take."""
    if layout.ep > 1 and layout.dp > 1 and not layout.dp_attention:
        raise LayoutError(f"--ep-size {layout.ep} with --dp-size {layout.dp} needs --enable-dp-attention (independent "
                          f"replicas cannot share an expert all-to-all)")
    if layout.ep > 1 and layout.ep != layout.moe_span:
        raise LayoutError(f"--ep-size {layout.ep} must equal --tp-size ({layout.moe_span}) for now (experts split "
                          f"whole over every rank of the MoE layers; experts also split within a rank group are "
                          f"not built yet)")
    if layout.dp > 1 and layout.nnodes > 1:
        raise LayoutError(f"--dp-size {layout.dp} with --nnodes {layout.nnodes} is not supported yet: run one "
                          f"multi-node server per replica and put `shardserve router` in front")
    node.check(layout)
    check_device(cfg.device, layout)
    check_quantization(cfg, ckpt)
    mc = read_model_config(ckpt)
    layout.check_model(mc.num_layers, mc.num_heads, mc.num_experts)
    check_context(cfg, mc)
    check_kv_budget(cfg, layout, mc)
    if cfg.ep_num_redundant_experts or cfg.ep_expert_placement:
        check_placement(cfg, layout, mc)
    if cfg.pp_layer_partition is not None or layout.pp > 1:
        from shardserve.distributed.pipeline import split_layers  # torch: imported only when checked

        split_layers(mc.num_layers, layout.pp, cfg.pp_layer_partition)
    if (cfg.pp_micro_batches or 1) > 1 and layout.pp == 1:
        raise LayoutError(f"--pp-micro-batches {cfg.pp_micro_batches} needs --pp-size > 1 (one stage runs one "
                          f"micro-batch at a time)")


def check_quantization(cfg: EngineConfig, ckpt: Checkpoint) -> None:
    """--quantization int8 where it cannot run (each rank would fail the same way after start)."""
    if cfg.quantization != "int8":
        return
    if ckpt.is_gguf:
        raise LayoutError("--quantization int8 quantizes a safetensors checkpoint at load; a GGUF keeps its own "
                          "formats (--quantization auto) or is expanded (none)")
    if cfg.dtype != "float32" or (cfg.device or "cpu").startswith("cuda"):
        raise LayoutError(f"--quantization int8 runs on the CPU in float32, not --dtype {cfg.dtype} on "
                          f"{cfg.device or 'the default device'}")


def check_placement(cfg: EngineConfig, layout: Layout, mc) -> None:
    """Hot-expert replicas: refuse what would fail on every rank after model load."""
    if layout.ep == 1:
        raise LayoutError("--ep-num-redundant-experts and --ep-expert-placement need --ep-size > 1 (or "
                          "--enable-dp-attention)")
    if not cfg.ep_num_redundant_experts:
        raise LayoutError("--ep-expert-placement needs --ep-num-redundant-experts > 0 (without extra slots the "
                          "placement is the contiguous split and the file would go unused)")
    counts = load_counts(cfg.ep_expert_placement, mc.num_experts).layers if cfg.ep_expert_placement else None
    plan = PlacementPlan(layout.ep, cfg.ep_num_redundant_experts, counts)
    for layer in range(mc.num_layers):
        if mc.is_moe_layer(layer):
            plan.for_layer(layer, mc.num_experts)


def heartbeat_timeout(cfg: EngineConfig) -> float:
    """Silence after which a node counts as lost. Launchers beat every 0.5 s and do little else."""
    return min(5.0, cfg.dist_timeout)


def endpoints(layout: Layout, node: NodeSpec, num_tokenizers: int, torchrun: bool = False) -> Endpoints:
    """With ranks that are not this launcher's children (other nodes, torchrun's processes) the
    fan-out is TCP on node 0; otherwise an ipc path."""
    remote = layout.nnodes > 1 or torchrun
    return Endpoints.create(num_tokenizers, fanout_tcp=node.fanout if remote else "",
                            results_tcp=node.results if remote else "", dp=layout.dp, secret=node.secret)


class LocalGrid:
    """`torchrun=True`: the other ranks are torchrun's processes, so start scheduler-0 alone (it
    joins torch's rendezvous through the inherited environment) and run no node channel."""

    def __init__(self, cfg: EngineConfig, layout: Layout, node: NodeSpec, ep: Endpoints, model_name: str,
                 others: list[Child] = (), torchrun: bool = False):
        if torchrun:
            ranks = scheduler_children(cfg, ep, layout, "env://", only=range(1))
        else:
            master = node.rendezvous if layout.nnodes > 1 else ""
            ranks = scheduler_children(cfg, ep, layout, master, node.node_rank)
        self.tree = ProcessTree(ep, ranks + list(others))
        self.layout = layout
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

    def stop(self) -> None:
        if self.nodes is not None:
            self.nodes.stop()
        self.tree.stop()


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
