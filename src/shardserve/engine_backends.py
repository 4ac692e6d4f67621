"""Where the offline `LLM` runs its engine: in this process, or in N scheduler processes.

Both backends take tokenized requests and hand back `TokenOut` items, so `LLM` is the same
code for one device and for tensor parallelism. The multi-process backend is the server's
process tree minus HTTP and tokenizer workers: this process talks ZeroMQ to scheduler-0.
"""

from __future__ import annotations

import logging
import time

import zmq

from shardserve.config import EngineConfig
from shardserve.distributed.layout import Layout
from shardserve.ipc.messages.api import AbortReq, AddRequests, ErrorOut, TokenBatch, TokenizedReq, TokenOut
from shardserve.ipc.messages.reports import RankReports, ReportReq, Stats, merge_stats
from shardserve.ipc.sockets import Endpoints, bind_address, bound, gate_for, push, recv, send
from shardserve.launch.grid import LocalGrid, endpoints, place
from shardserve.launch.nodes import NodeSpec
from shardserve.multimodal import ImageInput
from shardserve.router.replicas import router_child
from shardserve.sampling_params import SamplingParams
from shardserve.scheduler.engine_core import EngineCore, RequestLimits
from shardserve.scheduler.outputs import token_out

log = logging.getLogger(__name__)
INBOX = "the offline engine's inbox (scheduler-0's outputs)"


class LocalBackend:
    def __init__(self, cfg: EngineConfig, decode, tokenizer=None):
        self.engine = EngineCore(cfg, decode=decode, tokenizer=tokenizer)
        self.limits = self.engine.limits
        self.infos = {"scheduler-0": self.engine.worker.info()}

    def add(self, items: list[tuple[str, list[int], SamplingParams, tuple[ImageInput, ...]]]) -> None:
        """All or none: a request the engine refuses takes those added before it back out."""
        added = []
        try:
            for rid, ids, params, images in items:
                self.engine.add_request(rid, ids, params, images=images)
                added.append(rid)
        except BaseException:
            for rid in added:
                self.engine.abort(rid)
            raise

    def rank_reports(self) -> list[dict]:
        return [self.engine.traffic_by_group()]

    def poll(self) -> list[TokenOut]:
        return [token_out(o) for o in self.engine.step()]

    def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    def stats(self) -> Stats:
        return self.engine.stats()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine = None


def offline_inbox(ctx: zmq.Context, ep: Endpoints, gate) -> zmq.Socket:
    """One PULL socket bound where the leaders send tokens (the detokenizer's address) and
    errors (the API's): the offline API is both."""
    sock = bound(ctx, zmq.PULL, ep.detokenizer, ep.secret, gate, "the offline inbox")
    sock.bind(bind_address(ep.api))
    return sock


class ProcessBackend:
    """One scheduler process per rank of `layout` on this machine (node 0 of several, or the
    only one); requests go to rank 0, the leader, which fans them out (with several replicas, to
    the router, which picks a replica's leader)."""

    def __init__(self, cfg: EngineConfig, layout: Layout, node: NodeSpec, model_name: str,
                 startup_timeout: float = 600.0, load_balance_method: str = "cache_aware"):
        self.replicas = layout.dp
        placement = place(cfg, layout, node, startup_timeout)  # with Ray: where each rank runs
        try:
            self.ep = endpoints(layout, node, 1, placement=placement)
            router = ([router_child(self.ep, load_balance_method, cfg.page_size, cfg.enable_prefix_cache,
                                    layout.dp_attention)]
                      if layout.dp > 1 else [])
            self.grid = LocalGrid(cfg, layout, node, self.ep, model_name, router, placement=placement)
        except BaseException:
            if placement is not None:
                placement.release()
            raise
        self.ctx = zmq.Context()
        self.gate = self.inbox = self.to_scheduler = None
        self.timeout_s = cfg.dist_timeout
        try:
            # scheduler-0's token and error outputs (TCP when Ray placed the leaders elsewhere)
            self.gate = gate_for(self.ctx, self.ep.secret, self.ep.api)
            self.inbox = offline_inbox(self.ctx, self.ep, self.gate)
            self.to_scheduler = push(self.ctx, self.ep.scheduler, self.ep.secret)
            self.infos = self.grid.start(startup_timeout)
            # With several nodes this also keeps the heartbeats going; poll() reports a failure.
            self.grid.watch(lambda reason: log.error("%s", reason))
        except BaseException:
            self.shutdown()
            raise
        self.limits = RequestLimits(**self.infos["scheduler-0"]["limits"])
        self.last_stats: dict[int, Stats] = {}  # by replica
        self.finished = 0

    def add(self, items: list[tuple[str, list[int], SamplingParams, tuple[ImageInput, ...]]]) -> None:
        """One message: scheduler-0 admits them all before its next step."""
        send(self.to_scheduler, AddRequests(items=[TokenizedReq(rid=rid, token_ids=ids, params=params,
                                                                images=list(images))
                                                   for rid, ids, params, images in items]))

    def rank_reports(self) -> list[dict]:
        """Every rank's traffic, gathered by each replica's leader over its control group."""
        rid = f"report-{time.monotonic_ns()}"
        send(self.to_scheduler, ReportReq(rid=rid))
        deadline = time.monotonic() + self.timeout_s
        reports: list[list[dict]] = []
        while time.monotonic() < deadline:
            msg = recv(self.inbox, timeout_ms=100, where=INBOX)
            if isinstance(msg, RankReports) and msg.rid == rid:
                reports.append(msg.reports)
                if len(reports) == self.replicas:
                    return sorted((r for rep in reports for r in rep), key=lambda r: r["rank"])
            if isinstance(msg, Stats):
                self.last_stats[msg.replica] = msg
        raise RuntimeError(f"rank reports from {len(reports)} of {self.replicas} replica leaders within "
                           f"{self.timeout_s:.0f} s")

    def poll(self) -> list[TokenOut]:
        deadline = time.monotonic() + self.timeout_s
        while (msg := recv(self.inbox, timeout_ms=500, where=INBOX)) is None:
            broken = self.grid.failure()  # a dead rank or a lost node: say which, now
            if broken:
                raise RuntimeError(broken)
            if time.monotonic() > deadline:
                who = "the replica leaders" if self.replicas > 1 else "scheduler-0"
                raise RuntimeError(f"no output from {who} in {self.timeout_s:.0f} s")
        if isinstance(msg, ErrorOut):
            raise ValueError(msg.message)
        if isinstance(msg, Stats):
            self.last_stats[msg.replica] = msg
        if not isinstance(msg, TokenBatch):
            return []
        self.finished += sum(o.finished for o in msg.items)
        return msg.items

    def stats(self, wait_s: float = 5.0) -> Stats | None:
        """The leaders' stats (summed over replicas) as of every request this process has seen
        finish (the report sent on falling idle can trail the last tokens, so wait for it)."""
        deadline = time.monotonic() + wait_s
        while sum(s.finished for s in self.last_stats.values()) < self.finished or not self.last_stats:
            msg = recv(self.inbox, timeout_ms=50, where=INBOX)
            if isinstance(msg, Stats):
                self.last_stats[msg.replica] = msg
            if time.monotonic() > deadline:
                break
        while isinstance(msg := recv(self.inbox, timeout_ms=0, where=INBOX), Stats):  # and any newer ones already here
            self.last_stats[msg.replica] = msg
        return merge_stats(list(self.last_stats.values())) if self.last_stats else None

    def abort(self, rid: str) -> None:
        send(self.to_scheduler, AbortReq(rid=rid))

    def shutdown(self) -> None:
        self.grid.stop()
        for sock in (self.inbox, self.to_scheduler):
            if sock is not None:  # None: start-up failed before it was made
                sock.close(linger=0)
        if self.gate is not None:
            self.gate.stop()
        self.ctx.term()
