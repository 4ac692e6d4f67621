"""Started by torchrun: each process is one rank, told so by the environment.

`torchrun --nnodes N --nproc-per-node R -m shardserve serve --tp-size ...` starts N x R
processes with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.
The process with RANK 0 is node 0's API process: it starts scheduler-0 as its child (which
inherits that environment and joins torch's rendezvous with `env://`) and the tokenizer workers.
Every other process runs its scheduler rank in place, starting nothing. torchrun itself watches
the processes: one that dies takes the others down.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import sys
from dataclasses import dataclass

from shardserve.config import EngineConfig
from shardserve.distributed.layout import Layout, LayoutError, RankSpec
from shardserve.ipc.child import setup_logging
from shardserve.ipc.sockets import Endpoints
from shardserve.launch.nodes import NodeSpec

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world: int
    local_world: int
    master_addr: str
    master_port: int

    @property
    def nnodes(self) -> int:
        return self.world // self.local_world

    def node(self, secret: bytes = b"") -> NodeSpec:
        """Our own ports (node channel +1, plan feed +2, results +3) sit beside torchrun's MASTER_PORT."""
        return NodeSpec(self.rank // self.local_world, f"{self.master_addr}:{self.master_port}", secret)


def torchrun_env() -> TorchrunEnv | None:
    """The torchrun environment of this process, or None when it was not started by torchrun."""
    if not all(k in os.environ for k in ENV):
        return None
    world = int(os.environ["WORLD_SIZE"])
    return TorchrunEnv(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                       os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))


def torchrun_layout(layout: Layout, env: TorchrunEnv) -> Layout:
    """The flags' layout with torchrun's node count, checked against torchrun's world size."""
    grid = dataclasses.replace(layout, nnodes=env.nnodes)
    grid.check_world(env.world, "torchrun's WORLD_SIZE")
    if grid.dp > 1:
        raise LayoutError(f"--dp-size {grid.dp} under torchrun is not supported yet: start one server per replica "
                          f"and put `shardserve router` in front")
    return grid


def run_rank_here(cfg: EngineConfig, layout: Layout, env: TorchrunEnv, secret: bytes = b"") -> int:
    """A process with RANK > 0: run that scheduler rank in this process until rank 0 stops."""
    name = f"scheduler-{env.rank}"
    setup_logging(name)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))
    ep = Endpoints.create(1, fanout_tcp=env.node().fanout, results_tcp=env.node().results, secret=secret)
    try:
        from shardserve.scheduler.process import rank_server  # the engine, in this rank's process only

        server = rank_server(cfg, ep, RankSpec(env.rank, layout, "env://"))
        logging.getLogger("shardserve.launch").info("%s ready (torchrun rank %d of %d)", name, env.rank, env.world)
        server.serve()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    finally:
        shutil.rmtree(ep.root, ignore_errors=True)
    return 0

