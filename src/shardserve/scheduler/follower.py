"""Every rank but the leader: run the leader's plans, in order, until told to stop.

A follower decides nothing. It reads the plan feed (scheduler/inbox.py), runs its stage of each
plan, and, if it is the sampling rank (last stage, tensor rank 0), sends the micro-batch's result
back to the leader. Each later stage's tensor rank 0 also sends its traffic counts now and then,
so /metrics shows every stage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from shardserve.config import EngineConfig
from shardserve.distributed.communicator import CollectiveError
from shardserve.distributed.groups import ParallelGroups
from shardserve.engine.stage_worker import StageWorker
from shardserve.ipc.messages import Msg, encode
from shardserve.ipc.messages.lifecycle import Shutdown
from shardserve.ipc.messages.plan import StageTraffic, StepPlan, Tick
from shardserve.ipc.messages.reports import ReportReq
from shardserve.ipc.sockets import Endpoints, connected
from shardserve.loader.model_path import resolve_checkpoint
from shardserve.loader.weights import read_model_config, resolve_dtype
from shardserve.scheduler.inbox import Feed
from shardserve.scheduler.pd_decode import make_receiver

log = logging.getLogger(__name__)
TRAFFIC_INTERVAL = 0.25


def serve_loop(loop: Callable[[], None]) -> None:
    """Run a rank's loop (the leader's or a follower's); a failed collective ends the process
    with one line (it names this rank, the group and the operation; the launcher names the lost
    peer) and exit code 1."""
    try:
        loop()
    except CollectiveError as e:
        log.error("stopping: %s", str(e).splitlines()[0])
        raise SystemExit(1) from None


class Follower:
    def __init__(self, cfg: EngineConfig, ep: Endpoints, groups: ParallelGroups):
        ckpt = resolve_checkpoint(cfg.model)
        cfg = resolve_dtype(cfg, ckpt)
        self.groups = groups
        self.worker = StageWorker(cfg, ckpt, read_model_config(ckpt), groups, ep.secret)
        ctx = zmq.Context.instance()
        if cfg.disaggregation_mode == "decode":
            self.worker.receiver = make_receiver(cfg, self.worker.runner, ep.leader(groups.coords.dp), ep.secret)
        self.feed = Feed(ctx, ep.fanout(groups.coords.dp), groups.control, cfg.dist_timeout, ep.secret)
        stage = self.worker.stage
        self.reports_traffic = stage.count > 1 and not stage.first and groups.tensor.rank == 0
        self.to_leader = None
        if self.worker.samples or self.reports_traffic:
            self.to_leader = connected(ctx, zmq.PUSH, ep.results(groups.coords.dp), ep.secret)
            self.to_leader.setsockopt(zmq.LINGER, 1000)
        self.last_traffic = 0.0
        self.next_mb = 0  # plans are numbered 0, 1, 2, ...: a gap means the feed lost one

    def info(self) -> dict:
        return self.worker.info()

    def serve(self) -> None:
        serve_loop(self._loop)

    def _loop(self) -> None:
        while True:
            msg = self.feed.next()
            if isinstance(msg, StepPlan):
                if msg.mb != self.next_mb:
                    raise CollectiveError(f"rank {self.groups.rank}: the plan feed skipped from micro-batch "
                                          f"{self.next_mb} to {msg.mb}")
                self.next_mb += 1
                result = self.worker.execute(msg)
                if result is not None:
                    self._send(result, "result")
                self._maybe_send_traffic()
            elif isinstance(msg, Tick):
                self._maybe_send_traffic()
            elif isinstance(msg, ReportReq):
                # The leader drained every micro-batch first; all ranks gather here.
                self.worker.flush()
                self.groups.control.gather_objects(self.worker.rank_report())
            elif isinstance(msg, Shutdown):
                self.worker.flush()
                return

    def _send(self, msg: Msg, op: str) -> None:
        data = encode(msg)
        self.groups.control.count(op, len(data))
        self.to_leader.send(data, copy=False)

    def _maybe_send_traffic(self) -> None:
        now = time.monotonic()
        if not self.reports_traffic or now - self.last_traffic < TRAFFIC_INTERVAL:
            return
        self.last_traffic = now
        groups = self.groups.traffic_by_group()["groups"]
        self._send(StageTraffic(stage=self.worker.stage.index, rank=self.groups.rank, groups=groups), "stage_traffic")
