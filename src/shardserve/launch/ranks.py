"""The scheduler processes of one machine's share of the rank grid."""

from __future__ import annotations

import os
import socket

from shardserve.config import EngineConfig
from shardserve.distributed.layout import Layout, RankSpec
from shardserve.ipc.sockets import Endpoints
from shardserve.launch.process_tree import ByName, Child

# By name: the launcher (the API process) never imports the engine itself.
SCHEDULER_MAIN = ByName("shardserve.scheduler.process", "scheduler_main")


def scheduler_children(cfg: EngineConfig, ep: Endpoints, layout: Layout, master: str = "",
                       node: int = 0, only: range | None = None, placement=None) -> list[Child]:
    """One scheduler process per rank on `node` (or just the ranks in `only`). `master` is
    host:port of the rendezvous; when empty, a free local port, one per independent replica
    (each its own world, distributed/groups.py), so a replica can start again on its own.
    With a Ray `placement` (launch/ray_cluster.py) every rank starts on its actor's node."""
    ranks = only if only is not None else layout.node_ranks(node)
    if placement is not None:
        return ray_children(cfg, ep, layout, ranks, placement)
    masters: dict[int, str] = {}

    def master_of(rank: int) -> str:
        if master or layout.world == 1:
            return master
        key = layout.coords(rank).dp if layout.independent_replicas else 0
        if key not in masters:
            masters[key] = f"127.0.0.1:{free_port()}"
        return masters[key]

    env = thread_env(cfg, layout)
    return [Child(f"scheduler-{r}", SCHEDULER_MAIN, (cfg, ep, RankSpec(r, layout, master_of(r))), env=env,
                  role=role(layout, r))
            for r in ranks]


def ray_children(cfg: EngineConfig, ep: Endpoints, layout: Layout, ranks: range, placement) -> list[Child]:
    masters = placement.prepare(ranks)  # lost actors started again first: their nodes decide env and GPUs
    out = []
    for r in ranks:
        spec = RankSpec(r, layout, masters[r], placement.device_index(r))
        out.append(Child(f"scheduler-{r}", SCHEDULER_MAIN, (cfg, ep, spec), env=placement.env(r), role=role(layout, r),
                         spawn=placement.spawner(r, role(layout, r))))
    return out


def thread_env(cfg: EngineConfig, layout: Layout) -> dict[str, str] | None:
    """Each rank's CPU threads (--threads), set before it starts so torch and the C kernels'
    OpenMP (torch's own runtime) both take it. Without the flag, ranks sharing a machine share
    out its cores (each would otherwise take them all); a lone rank keeps torch's choice."""
    if cfg.threads is not None:
        return {"OMP_NUM_THREADS": str(cfg.threads)}
    if layout.ranks_per_node > 1:
        return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // layout.ranks_per_node))}
    return None


def role(layout: Layout, rank: int) -> str:
    """How reports name a rank's place, e.g. 'pipeline stage 1 of 2, tp 0' (empty with one rank)."""
    c = layout.coords(rank)
    parts = [f"pipeline stage {c.pp} of {layout.pp}"] if layout.pp > 1 else []
    parts += [f"{a} {getattr(c, a)}" for a in ("dp", "cp", "tp") if getattr(layout, a) > 1]
    return ", ".join(parts)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
