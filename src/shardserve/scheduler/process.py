"""The scheduler process (one per rank of the grid): the engine loop plus its I/O.

The replica's leader (rank 0 of its control group) runs `SchedulerServer`: per iteration it
takes new messages (adds, aborts, reports), runs one engine step (apply results that came back,
plan and run the next micro-batch) and sends each request's new tokens to the detokenizer; a
request the engine refuses gets an ErrorOut sent straight to the API. Every other rank runs
`Follower` (scheduler/follower.py): the leader's plans, in order.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import zmq

from shardserve.config import EngineConfig
from shardserve.distributed.groups import ParallelGroups, init_distributed, single_process_groups
from shardserve.distributed.layout import RankSpec
from shardserve.ipc.child import run_child
from shardserve.ipc.messages.api import AbortReq, AddRequests, ErrorOut, TokenBatch, TokenizedReq, TokenOut
from shardserve.ipc.messages.disagg import KVArrived
from shardserve.ipc.messages.lifecycle import Shutdown
from shardserve.ipc.messages.plan import Wake
from shardserve.ipc.messages.reports import RankReports, ReportReq
from shardserve.ipc.secure import SECRET_ENV, new_secret
from shardserve.ipc.sockets import Endpoints, push, send
from shardserve.loader.model_path import resolve_checkpoint
from shardserve.loader.tokenizer import load_tokenizer
from shardserve.platform import pick_device
from shardserve.scheduler.engine_core import EngineCore
from shardserve.scheduler.engine_results import StepOutput
from shardserve.scheduler.follower import Follower, serve_loop
from shardserve.scheduler.inbox import Inbox
from shardserve.scheduler.lockstep import Lockstep
from shardserve.scheduler.outputs import CacheEventFeed, token_out
from shardserve.scheduler.pd_decode import DecodeSide, make_receiver
from shardserve.scheduler.pd_prefill import PrefillSide
from shardserve.scheduler.startup import rank_text, startup_summary

log = logging.getLogger(__name__)
STATS_INTERVAL = 0.25
IDLE_WAIT_MS = 100
STALL_WAIT_MS = 100  # every micro-batch slot is in flight: wait this long for a result (or a message)


class SchedulerServer:
    """The leader of one engine replica (control rank 0): requests in, plans out, tokens out."""

    def __init__(self, cfg: EngineConfig, ep: Endpoints, groups: ParallelGroups):
        # The tokenizer loads on a thread while the model builds (imports and reads on both
        # sides, and the other ranks wait on this one's collectives, not on its tokenizer).
        pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        tok = pool.submit(load_tokenizer, resolve_checkpoint(cfg.model))
        tok.add_done_callback(_say_if_failed)
        pool.shutdown(wait=False)
        self.engine = EngineCore(cfg, groups=groups, tokenizer=tok, secret=ep.secret)
        ctx = zmq.Context.instance()
        self.replica = groups.coords.dp
        # After the engine: both sides meet in the same control-group collectives in the same order.
        results = ep.results(self.replica) if groups.layout.pp > 1 else None
        self.inbox = Inbox(ctx, ep.leader(self.replica), ep.fanout(self.replica), results, groups.control,
                           cfg.dist_timeout, ep.secret)
        self.engine.publish = self.inbox.publish if groups.control.size > 1 else None
        if groups.layout.pp > 1:  # else none, or (--async-scheduling) this rank's own executor's
            self.engine.results = self.inbox.take_results
        self.to_detok = push(ctx, ep.detokenizer, ep.secret)
        self.to_api = push(ctx, ep.api, ep.secret)
        self.aborted_early: set[str] = set()  # aborts that overtook their request
        self.events = CacheEventFeed(ctx, ep.events(self.replica), self.replica, self.engine.allocator,
                                     cfg.dist_timeout, ep.secret, self.inbox.gate) if ep.dp > 1 else None
        self.last_stats = 0.0
        self.last_status: dict = {}
        self.running = True
        self.lockstep = Lockstep(groups.data, cfg.dist_timeout) if groups.layout.dp_attention else None
        self.stopping = False  # told to shut down; under lockstep, stops when the replicas agree
        self.rank = groups.rank
        # Disaggregation: a prefill leader takes prompts from decode instances; a decode leader
        # has them computed there (scheduler/pd_prefill.py, pd_decode.py).
        self.prefill = self.decode = self.receiver = None
        if cfg.disaggregation_mode == "prefill":
            self.prefill = PrefillSide(self.engine, cfg, ep.secret, ctx)
        elif cfg.disaggregation_mode == "decode":
            worker = self.engine.worker
            self.receiver = worker.receiver = make_receiver(cfg, self.engine.runner, ep.leader(self.replica),
                                                            ep.secret)
            self.decode = DecodeSide(self.engine, cfg, ep.secret, ctx, self.receiver.cancel)

    def info(self) -> dict:
        return {"max_model_len": self.engine.max_model_len, "limits": dataclasses.asdict(self.engine.limits),
                **self.engine.worker.info()}

    def serve(self) -> None:
        try:
            serve_loop(self._loop if self.lockstep is None else self._lockstep_loop)
        finally:
            self.engine.close()

    def _loop(self) -> None:
        while self.running:
            idle = not self.engine.has_unfinished()
            stalled = self.engine.stalled()
            wait = IDLE_WAIT_MS if idle else STALL_WAIT_MS if stalled else 0
            for msg in self.inbox.receive(wait, results_too=stalled, also=self._channels()):
                self.handle(msg)
            if self.prefill is not None:
                self.prefill.receive()
            if self.decode is not None:
                self.emit(self.decode.step())
                for err in self.decode.take_errors():
                    send(self.to_api, err)
            outs = self.engine.step()
            if self.prefill is not None:
                outs = self.prefill.outputs(outs)
                self.prefill.tick()
            self.emit(outs)
            if self.events is not None:
                self.events.publish()
            self.maybe_send_stats()
            if idle:
                self.inbox.tick()

    def _channels(self) -> list:
        if self.prefill is not None:
            return [self.prefill.sock]
        return self.decode.sockets() if self.decode is not None else []

    def _lockstep_loop(self) -> None:
        """Data-parallel attention: one agreement per step over every replica's leader, then
        every replica steps (an empty plan where it has nothing to run) or none does
        (scheduler/lockstep.py says why)."""
        lock = self.lockstep
        catch_up: tuple[int, float] | None = None  # (wake to wait for, since when)
        while self.running:
            asleep = lock.sleeping() and not self.stopping
            for msg in self.inbox.receive(IDLE_WAIT_MS if asleep or catch_up else 0):
                self.handle(msg)
            if catch_up is not None and lock.wake_seen < catch_up[0] and not self.stopping:
                lock.check_catch_up(catch_up[1], catch_up[0], self.rank)
                continue
            catch_up = None
            if lock.sleeping() and not self.stopping:
                self.inbox.tick()
                self.maybe_send_stats()
                continue
            agreed = lock.agree(self.engine.has_unfinished(), self.stopping)
            if agreed.stop:
                self._stop()
                return
            if agreed.work:
                self.emit(self.engine.step(join=True))
                if self.events is not None:
                    self.events.publish()
            elif lock.behind(agreed):
                catch_up = (agreed.newest_wake, time.monotonic())
            self.maybe_send_stats(settled=not agreed.work)

    def _stop(self) -> None:
        self.emit(self.engine.drain())
        self.inbox.publish(Shutdown())
        self.engine.worker.flush()
        self.running = False

    def emit(self, outs: list[StepOutput]) -> None:
        if outs:
            send(self.to_detok, TokenBatch(items=[token_out(o) for o in outs]))
            self.ended(o.request.request_id for o in outs if o.finished)

    def ended(self, rids) -> None:
        if self.events is not None:
            self.events.ended.extend(rids)

    def handle(self, msg) -> None:
        if isinstance(msg, AddRequests):
            for item in msg.items:
                self.handle(item)
        elif isinstance(msg, ReportReq):
            # Every rank joins this gather once it has run every plan before it.
            self.emit(self.engine.drain())
            self.inbox.publish(msg)
            self.engine.worker.flush()
            reports = self.engine.control.gather_objects(self.engine.traffic_by_group())
            send(self.to_api, RankReports(rid=msg.rid, reports=reports))
        elif isinstance(msg, TokenizedReq):
            if msg.rid in self.aborted_early:
                self.aborted_early.discard(msg.rid)
                return
            try:
                if msg.auto_max_tokens:  # chat without max_tokens: whatever the context leaves
                    msg.params.max_tokens = max(1, self.engine.max_model_len - len(msg.token_ids))
                if self.decode is not None:
                    self.decode.add(msg)
                    return
                self.engine.add_request(msg.rid, msg.token_ids, msg.params, images=tuple(msg.images))
            except Exception as e:  # whatever a request carries, refusing it must not stop the engine
                send(self.to_api, ErrorOut(rid=msg.rid, message=str(e), status=400))
                self.ended([msg.rid])
        elif isinstance(msg, KVArrived):
            if self.decode is not None:
                self.decode.arrived(msg.room, msg.rank)
        elif isinstance(msg, AbortReq):
            if (self.decode is not None and self.decode.abort(msg.rid)) or self.engine.abort(msg.rid):
                # Tell the detokenizer too, so it forgets the stream.
                done = TokenOut(rid=msg.rid, new_ids=[], finished=True, finish_reason="abort")
                send(self.to_detok, TokenBatch(items=[done]))
                self.ended([msg.rid])
            else:
                self.aborted_early.add(msg.rid)
                if len(self.aborted_early) > 10000:
                    self.aborted_early.clear()
        elif isinstance(msg, Wake):
            if self.lockstep is not None:
                self.lockstep.saw_wake(msg.seq)
        elif isinstance(msg, Shutdown):
            self.stopping = True
            if self.lockstep is None:  # under lockstep: at the next agreement, with the others
                self._stop()

    def maybe_send_stats(self, settled: bool = False) -> None:
        """Send when something changed: at most every STATS_INTERVAL while busy (or stepping
        empty beside busy replicas), at once when the engine falls idle (so /metrics never shows a
        finished request as running), when every replica has (`settled`), or when requests start
        running on an idle engine (so it never shows a running one as idle)."""
        s = self.engine.running_status() | self._transfer_stats()  # KV sends complete on their own thread
        now = time.monotonic()
        busy = not settled and (self.engine.has_unfinished()
                                or s["empty_steps"] != self.last_status.get("empty_steps"))
        started = s["running"] and not self.last_status.get("running")
        if s == self.last_status or (busy and not started and now - self.last_stats < STATS_INTERVAL):
            return
        self.last_stats, self.last_status = now, s
        stats = self.engine.stats()
        stats.replica = self.replica
        stats.transfer = self._transfer_stats()
        send(self.to_api, stats)


    def _transfer_stats(self) -> dict:
        if self.prefill is not None:
            return {"mode": "prefill", **self.engine.worker.shipper.sender.stats.report()}
        if self.decode is not None:
            return {"mode": "decode", "requests": self.decode.received, "bytes": self.receiver.bytes,
                    "reserved_pages": self.decode.pages_reserved(), "waiting": len(self.decode.waiting)}
        return {}


def rank_server(cfg: EngineConfig, ep: Endpoints, spec: RankSpec) -> SchedulerServer | Follower:
    """Join the grid and build this rank's loop: the leader's, or a follower's."""
    device = pick_device(cfg.device, spec.local_rank)
    groups = (init_distributed(spec.layout, spec.rank, spec.master, device, cfg.dist_timeout)
              if spec.layout.world > 1 else single_process_groups())
    groups.device_index = spec.device_index
    ep = with_secret(ep, groups)
    if groups.control.rank != 0:
        return Follower(cfg, ep, groups)
    log.info("%s: loading the tokenizer and the model ...", rank_text(groups))
    server = SchedulerServer(cfg, ep, groups)
    log.info("%s", startup_summary(server.engine))  # the settings in force, once per replica
    return server


def _say_if_failed(tokenizer: Future) -> None:
    """At once: the rank's start fails on it only once the model is built, maybe minutes on."""
    if (e := tokenizer.exception()) is not None:
        log.error("the tokenizer failed to load (%s: %s); this rank stops once its model is built",
                  type(e).__name__, e)


def with_secret(ep: Endpoints, groups: ParallelGroups) -> Endpoints:
    """TCP plan feed without a deployment secret (torchrun, nothing set): rank 0 draws one and
    broadcasts it over the control group (gloo, between the ranks alone) before any channel opens."""
    if not ep.fanout_tcp or ep.secret:
        return ep
    buf = torch.zeros(64, dtype=torch.uint8)
    if groups.control.rank == 0:
        buf[:] = torch.frombuffer(bytearray(new_secret()), dtype=torch.uint8)
        log.warning("no %s set: the ranks' TCP channels are keyed by a secret drawn now and shared over "
                    "torch.distributed (set one to choose it)", SECRET_ENV)
    groups.control.broadcast(buf)
    return dataclasses.replace(ep, secret=bytes(buf.tolist()))


def scheduler_main(cfg: EngineConfig, ep: Endpoints, spec: RankSpec) -> None:
    """Process entry point (spawned by the launcher), one per rank."""

    def setup():
        server = rank_server(cfg, ep, spec)
        return server.serve, server.info()

    run_child(f"scheduler-{spec.rank}", ep.ready, setup, ep.secret)
