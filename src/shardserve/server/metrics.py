"""Prometheus metrics of one server (own registry, so two servers in one process never clash)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shardserve.ipc.messages.reports import RouterStats, Stats, merge_stats
from shardserve.server.replica_board import ReplicaBoard

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("shardserve_num_requests_running", "Requests being generated", registry=r)
        self.http = Counter("shardserve_http_requests", "HTTP requests answered, by endpoint (the route, e.g. "
                            "/v1/responses/{response_id}) and status", ["endpoint", "status"], registry=r)
        self.waiting = Gauge("shardserve_num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.pages_used = Gauge("shardserve_kv_pages_used", "KV cache pages in use", registry=r)
        self.pages_total = Gauge("shardserve_kv_pages_total", "KV cache pages in the pool", registry=r)
        self.steps = Gauge("shardserve_engine_steps", "Engine steps run so far", registry=r)
        self.empty_steps = Gauge("shardserve_engine_empty_steps", "Steps run over no tokens so far (data-parallel "
                                 "attention: an idle replica joining the others' MoE all-to-alls)", registry=r)
        self.finished = Gauge("shardserve_engine_requests_finished", "Requests finished or aborted in the engine",
                              registry=r)
        self.hit_rate = Gauge("shardserve_prefix_cache_hit_rate", "Prompt tokens served from cache", registry=r)
        self.prompt_tokens = Counter("shardserve_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("shardserve_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("shardserve_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("shardserve_inter_token_latency_seconds", "Time between tokens",
                             buckets=_LATENCY, registry=r)
        self.comm_calls = Gauge("shardserve_comm_calls", "Collective calls by rank 0", ["op"], registry=r)
        self.comm_bytes = Gauge("shardserve_comm_bytes", "Collective bytes sent by rank 0", ["op"], registry=r)
        self.stage_calls = Gauge("shardserve_stage_comm_calls", "Calls by each pipeline stage's tensor rank 0",
                                 ["stage", "group", "op"], registry=r)
        self.stage_bytes = Gauge("shardserve_stage_comm_bytes", "Bytes sent by each pipeline stage's tensor rank 0",
                                 ["stage", "group", "op"], registry=r)
        self.in_flight = Gauge("shardserve_max_micro_batches_in_flight", "Most micro-batches in flight at once",
                               registry=r)
        self.preemptions = Gauge("shardserve_num_preemptions", "Requests preempted so far", registry=r)
        self.expert_routed = Gauge("shardserve_expert_routed_tokens", "Token-expert pairs each MoE layer's gate "
                                   "chose per expert (first pipeline stage's layers), over all replicas",
                                   ["layer", "expert"], registry=r)
        self.transfer = Gauge("shardserve_kv_transfer", "Disaggregation: KV shipped (prefill instance: requests, "
                              "bytes, early_bytes sent before the chunk's last layer was computed, chunks, "
                              "early_chunks whose layer 0 left before their last layer was computed, exposed_s "
                              "after it, failed) or received (decode instance: requests, bytes, reserved_pages, "
                              "waiting)", ["field"], registry=r)
        spec = ["method"]
        self.spec = {k: Gauge(f"shardserve_spec_decode_{name}", what, spec, registry=r) for k, name, what in (
            ("drafts", "num_drafts", "Speculative decoding: request-steps given proposals"),
            ("proposed", "num_draft_tokens", "Speculative decoding: tokens proposed"),
            ("accepted", "num_accepted_tokens", "Speculative decoding: proposals the target accepted"),
            ("emitted", "num_emitted_tokens", "Speculative decoding: tokens emitted by verified steps (accepted "
                                              "proposals and the target's own token)"),
        )}
        self.spec_rate = Gauge("shardserve_spec_decode_acceptance_rate", "Accepted / proposed tokens", spec, registry=r)
        self.spec_length = Gauge("shardserve_spec_decode_mean_accepted_length", "Tokens emitted per verified step "
                                 "(1 + accepted proposals per step)", spec, registry=r)
        self.spec_pos = Gauge("shardserve_spec_decode_num_accepted_tokens_per_pos", "Proposals accepted, by their "
                              "position in the step's proposals", ["method", "position"], registry=r)
        self.lora_slots = Gauge("shardserve_lora_slots", "LoRA adapter slots, and those holding an adapter",
                                ["state"], registry=r)
        self.lora_loads = Gauge("shardserve_lora_slot_loads", "Adapters put into a slot so far", registry=r)
        self.lora_requests = Gauge("shardserve_lora_requests", "Requests per LoRA adapter, running or waiting",
                                   ["adapter", "state"], registry=r)
        per = ["replica"]
        self.r_running = Gauge("shardserve_replica_num_requests_running", "Requests running, per data-parallel "
                               "replica", per, registry=r)
        self.r_waiting = Gauge("shardserve_replica_num_requests_waiting", "Requests waiting, per replica", per,
                               registry=r)
        self.r_pages = Gauge("shardserve_replica_kv_pages_used", "KV pages in use, per replica", per, registry=r)
        self.r_hit_rate = Gauge("shardserve_replica_prefix_cache_hit_rate", "Prompt tokens served from cache, "
                                "per replica", per, registry=r)
        self.r_routed = Gauge("shardserve_replica_routed_requests", "Requests the router sent to each replica",
                              per, registry=r)
        self.r_prompt = Gauge("shardserve_replica_routed_prompt_tokens", "Prompt tokens of the requests sent to "
                              "each replica", per, registry=r)
        self.r_load = Gauge("shardserve_replica_load_tokens", "Outstanding tokens the router counts per replica",
                            per, registry=r)
        self.r_up = Gauge("shardserve_replica_up", "1 while a replica serves, 0 while it starts again or is down",
                          per, registry=r)
        self.r_restarts = Gauge("shardserve_replica_restarts", "Times a replica was started again after dying", per,
                                registry=r)
        self.r_again = Gauge("shardserve_replica_requests_placed_again", "Requests a dead replica held that had "
                             "streamed nothing, sent to another replica", per, registry=r)
        self.r_cut = Gauge("shardserve_replica_requests_cut_off", "Requests a dead replica held that had streamed, "
                           "ended with a 503", per, registry=r)

    def update(self, by_replica: dict[int, Stats], router: RouterStats | None = None,
               board: ReplicaBoard | None = None, retired: Stats | None = None) -> None:
        """Totals over the replicas (rank 0's traffic and stages) and what replicas that died had
        counted (`retired`), and each replica's own numbers."""
        if board is not None and len(board.replicas) > 1:
            for d, st in enumerate(board.replicas):
                self.r_up.labels(d).set(st.state == "serving")
                self.r_restarts.labels(d).set(st.restarts)
                self.r_again.labels(d).set(st.placed_again)
                self.r_cut.labels(d).set(st.cut_off)
                if d not in by_replica:  # died: what it ran is gone with it
                    for g in (self.r_running, self.r_waiting, self.r_pages):
                        g.labels(d).set(0)
        if router is not None:
            for d, (routed, prompt, load) in enumerate(zip(router.routed, router.prompt_tokens, router.load_tokens)):
                self.r_routed.labels(d).set(routed)
                self.r_prompt.labels(d).set(prompt)
                self.r_load.labels(d).set(load)
        if not by_replica:
            return
        for d, s in by_replica.items():
            self.r_running.labels(d).set(s.running)
            self.r_waiting.labels(d).set(s.waiting)
            self.r_pages.labels(d).set(s.pages_used)
            self.r_hit_rate.labels(d).set(s.prefix_hit_rate)
        self._update_totals(merge_stats([*by_replica.values(), *([retired] if retired is not None else [])]))

    def _update_totals(self, s: Stats) -> None:
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.pages_used.set(s.pages_used)
        self.pages_total.set(s.pages_total)
        self.hit_rate.set(s.prefix_hit_rate)
        self.steps.set(s.steps)
        self.empty_steps.set(s.empty_steps)
        self.finished.set(s.finished)
        self.in_flight.set(s.max_in_flight)
        self.preemptions.set(s.preemptions)
        for layer, row in s.expert_routed.items():
            for expert, count in enumerate(row):
                self.expert_routed.labels(layer, expert).set(count)
        for name, value in s.transfer.items():
            if isinstance(value, int | float):
                self.transfer.labels(name).set(value)
        if s.speculative:
            self._update_speculative(s.speculative)
        if s.lora:
            self._update_lora(s.lora)
        for op, rec in s.traffic.items():
            self.comm_calls.labels(op).set(rec["calls"])
            self.comm_bytes.labels(op).set(rec["MB"] * 1e6)
        for stage, groups in s.stages.items():
            for group, ops in groups.items():
                for op, rec in ops.items():
                    self.stage_calls.labels(stage, group, op).set(rec["calls"])
                    self.stage_bytes.labels(stage, group, op).set(rec["MB"] * 1e6)

    def _update_speculative(self, c: dict) -> None:
        m = c["method"]
        for key, gauge in self.spec.items():
            gauge.labels(m).set(c[key])
        self.spec_rate.labels(m).set(c["accepted"] / c["proposed"] if c["proposed"] else 0.0)
        self.spec_length.labels(m).set(c["emitted"] / c["drafts"] if c["drafts"] else 0.0)
        for pos, count in enumerate(c["per_position"]):
            self.spec_pos.labels(m, pos).set(count)

    def _update_lora(self, c: dict) -> None:
        self.lora_slots.labels("total").set(c["slots"])
        self.lora_slots.labels("used").set(c["slots_used"])
        self.lora_loads.set(c["loads"])
        self.lora_requests.clear()  # an adapter no request uses any more leaves the listing
        for state in ("running", "waiting"):
            for name, n in c[state].items():
                self.lora_requests.labels(name, state).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class CountResponses:
    """Counts each HTTP answer by route and status as it starts (`Metrics.http`); an exception
    that escapes every handler counts as the 500 it becomes. Plain ASGI, for the reason given at
    http_common._KeyGate."""

    def __init__(self, app: ASGIApp, counter: Counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def counted(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self._count(scope, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            if not started:
                self._count(scope, 500)
            raise

    def _count(self, scope: Scope, status: int) -> None:
        # The router records the matched route in the scope it was handed, which is this one.
        self.counter.labels(getattr(scope.get("route"), "path", "unmatched"), str(status)).inc()
