"""The scheduler process: the engine loop plus its I/O with the rest of the server.

Per iteration: take every pending message (blocking briefly only when idle), add or abort
requests, run one engine step, send each request's new tokens to the detokenizer. A request
the engine refuses gets an ErrorOut sent straight to the API.
"""

from __future__ import annotations

import logging
import time

import zmq

from shardserve.config import EngineConfig
from shardserve.ipc.child import run_child
from shardserve.ipc.messages import AbortReq, ErrorOut, Shutdown, Stats, TokenBatch, TokenizedReq, TokenOut
from shardserve.ipc.sockets import Endpoints, pull, push, recv, recv_all, send
from shardserve.loader.model_path import resolve_checkpoint
from shardserve.loader.tokenizer import load_tokenizer
from shardserve.scheduler.engine_core import EngineCore, StepOutput

log = logging.getLogger(__name__)
STATS_INTERVAL = 0.25


class SchedulerServer:
    def __init__(self, cfg: EngineConfig, ep: Endpoints):
        tok = load_tokenizer(resolve_checkpoint(cfg.model))
        decode = (lambda ids, skip: tok.decode(ids, skip_special_tokens=skip)) if tok else None
        eos = (tok.eos_token_id,) if tok is not None and tok.eos_token_id is not None else ()
        self.engine = EngineCore(cfg, decode=decode, extra_eos=eos)
        ctx = zmq.Context.instance()
        self.inbox = pull(ctx, ep.scheduler)
        self.to_detok = push(ctx, ep.detokenizer)
        self.to_api = push(ctx, ep.api)
        self.aborted_early: set[str] = set()  # aborts that overtook their request
        self.last_stats = 0.0
        self.last_status: dict = {}
        self.running = True

    def info(self) -> dict:
        e = self.engine
        return {"max_model_len": e.max_model_len, "vocab_size": e.vocab_size, "num_pages": e.allocator.num_pages}

    def serve(self) -> None:
        while self.running:
            idle = not self.engine.has_unfinished()
            first = recv(self.inbox, timeout_ms=100) if idle else None
            for msg in ([first] if first else []) + recv_all(self.inbox):
                self.handle(msg)
            outs = self.engine.step()
            if outs:
                send(self.to_detok, TokenBatch(items=[token_out(o) for o in outs]))
            self.maybe_send_stats()

    def handle(self, msg) -> None:
        if isinstance(msg, TokenizedReq):
            if msg.rid in self.aborted_early:
                self.aborted_early.discard(msg.rid)
                return
            try:
                if msg.auto_max_tokens:  # chat without max_tokens: whatever the context leaves
                    msg.params.max_tokens = max(1, self.engine.max_model_len - len(msg.token_ids))
                self.engine.add_request(msg.rid, msg.token_ids, msg.params)
            except ValueError as e:
                send(self.to_api, ErrorOut(rid=msg.rid, message=str(e), status=400))
        elif isinstance(msg, AbortReq):
            if self.engine.abort(msg.rid):
                # Tell the detokenizer too, so it forgets the stream.
                done = TokenOut(rid=msg.rid, new_ids=[], finished=True, finish_reason="abort")
                send(self.to_detok, TokenBatch(items=[done]))
            else:
                self.aborted_early.add(msg.rid)
                if len(self.aborted_early) > 10000:
                    self.aborted_early.clear()
        elif isinstance(msg, Shutdown):
            self.running = False

    def maybe_send_stats(self) -> None:
        """Send when something changed: at most every STATS_INTERVAL while busy, at once when
        the engine falls idle (so /metrics never shows a finished request as running)."""
        s = self.engine.running_status()
        now = time.monotonic()
        busy = self.engine.has_unfinished()
        if s == self.last_status or (busy and now - self.last_stats < STATS_INTERVAL):
            return
        self.last_stats, self.last_status = now, s
        send(self.to_api, Stats(running=s["running"], waiting=s["waiting"], pages_used=s["pages_used"],
                                pages_total=s["pages_total"], prefix_hit_rate=self.engine.allocator.hit_rate,
                                traffic=self.engine.runner.comm.traffic_report()))


def token_out(o: StepOutput) -> TokenOut:
    r = o.request
    p = r.params
    return TokenOut(
        rid=r.request_id, new_ids=o.new_token_ids, finished=o.finished, finish_reason=r.finish_reason,
        stop_reason=r.stop_reason, text_cut=r.text_cut, hold=max((len(s) for s in p.stop), default=1) - 1,
        skip_special_tokens=p.skip_special_tokens, logprobs=r.logprobs[-1:] if p.logprobs is not None else None,
        prompt_tokens=len(r.prompt_token_ids), cached_tokens=r.num_cached_tokens,
    )


def scheduler_main(cfg: EngineConfig, ep: Endpoints) -> None:
    """Process entry point (spawned by the launcher)."""

    def setup():
        server = SchedulerServer(cfg, ep)
        return server.serve, server.info()

    run_child("scheduler", ep.ready, setup)
