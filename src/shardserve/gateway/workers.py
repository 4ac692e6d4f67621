"""The standalone router's workers: who is healthy (background checks of each `/health`, and
failures seen while forwarding), and the per-worker Prometheus metrics.

A worker's health is the policy's `ReplicaState.healthy`, so the policy skips a dead worker the
moment either a check or a forwarded request finds it down, and takes it back at the first
check that passes.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shardserve.router.policy import Router

log = logging.getLogger("shardserve.router")

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class WorkerMetrics:
    """Per-worker counters in a registry of their own (the router serves only these). With
    `roles` (PD mode) every series also carries its worker's role, and the prefill and decode pools
    share one WorkerMetrics, so /metrics shows each family once."""

    def __init__(self, roles: bool = False):
        self.registry = reg = CollectorRegistry()
        w = ["worker", "role"] if roles else ["worker"]
        self.requests = Counter("shardserve_router_requests", "Requests sent to a worker (each try counts)", w,
                                registry=reg)
        self.errors = Counter("shardserve_router_errors",
                              "Tries that failed at a worker: no connection, timeout, 5xx, or a broken stream", w,
                              registry=reg)
        self.latency = Histogram("shardserve_router_request_latency_seconds",
                                 "Send to last byte, for tries a worker answered", w, buckets=LATENCY_BUCKETS,
                                 registry=reg)
        self.in_flight = Gauge("shardserve_router_in_flight_requests", "Requests now at a worker", w, registry=reg)
        self.healthy = Gauge("shardserve_router_worker_healthy", "1 while the router sends to a worker", w,
                             registry=reg)
        self.load = Gauge("shardserve_router_load_tokens",
                          "Outstanding tokens the router has sent a worker (prompt not cached + decode)", w,
                          registry=reg)
        # A gauge named like the server's per-replica one, so `bench serve` reads either the same way.
        self.prompt_tokens = Gauge("shardserve_router_routed_prompt_tokens",
                                   "Prompt tokens of the requests sent to a worker (a quarter per character "
                                   "without a tokenizer)", w, registry=reg)
        self.tree_pages = Gauge("shardserve_router_tree_pages", "Prompt pages the router believes a worker holds",
                                w, registry=reg)

    def add_worker(self, *labels: str) -> None:
        """Make a worker's counters exist from the start, at 0."""
        for metric in (self.requests, self.errors, self.latency):
            metric.labels(*labels)


class WorkerPool:
    def __init__(self, urls: list[str], router: Router, client: httpx.AsyncClient, check_timeout: float,
                 role: str | None = None, metrics: WorkerMetrics | None = None):
        """`role` ("prefill" or "decode") names a PD mode pool: in its log lines, and as a label on its
        series in `metrics` (shared with the other pool; a plain pool has its own)."""
        self.urls = [u.rstrip("/") for u in urls]
        self.router, self.client, self.check_timeout, self.role = router, client, check_timeout, role
        self.metrics = metrics if metrics is not None else WorkerMetrics(roles=role is not None)
        for i in range(len(self.urls)):
            self.metrics.add_worker(*self.labels(i))

    @property
    def noun(self) -> str:
        return "worker" if self.role is None else f"{self.role} instance"

    def labels(self, i: int) -> tuple[str, ...]:
        return (self.urls[i],) if self.role is None else (self.urls[i], self.role)

    def series(self, metric, i: int):
        """`metric`'s series for worker `i`."""
        return metric.labels(*self.labels(i))

    def is_healthy(self, i: int) -> bool:
        return self.router.replicas[i].healthy

    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.router.replicas)

    def mark(self, i: int, healthy: bool, reason: str = "") -> None:
        """Set worker `i`'s health, logging one line when it changes."""
        replica = self.router.replicas[i]
        if replica.healthy == healthy:
            return
        replica.healthy = healthy
        if healthy:
            log.info("%s %s is healthy again; routing to it", self.noun, self.urls[i])
        else:
            # What it held may be gone when it comes back (a restart starts with an empty cache):
            # believe nothing rather than pull requests to pages it no longer has.
            replica.prefixes.clear()
            log.warning("%s %s is down (%s); not routing to it", self.noun, self.urls[i], reason)

    def failed(self, i: int, reason: str) -> None:
        """Worker `i` is gone (see `is_down`): count it and stop routing there until a check passes."""
        self.series(self.metrics.errors, i).inc()
        self.mark(i, False, reason)

    async def check(self, i: int) -> None:
        reason = await self.probe(i)
        self.mark(i, reason is None, reason or "")

    async def probe(self, i: int) -> str | None:
        """Why worker `i` must not be routed to, by one check; None when it may."""
        try:
            r = await self.client.get(self.urls[i] + "/health", timeout=self.check_timeout)
        except httpx.HTTPError as e:
            return describe(e)
        return None if r.status_code == 200 else f"/health answered {r.status_code}"

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(i) for i in range(len(self.urls))))

    async def run(self, interval: float) -> None:
        """Check every worker each `interval` seconds, until cancelled."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.check_all()
            except Exception:  # a bug here must not end the checks: dead workers would stay out for good
                log.exception("health check failed")

    def set_gauges(self) -> None:
        m = self.metrics
        for i, r in enumerate(self.router.replicas):
            self.series(m.in_flight, i).set(r.in_flight)
            self.series(m.healthy, i).set(1 if r.healthy else 0)
            self.series(m.load, i).set(r.load)
            self.series(m.prompt_tokens, i).set(r.prompt_tokens)
            self.series(m.tree_pages, i).set(len(r.prefixes))

    def render(self) -> bytes:
        """Every series in this pool's registry (the other pool's too, when they share it)."""
        self.set_gauges()
        return generate_latest(self.metrics.registry)


def is_down(e: httpx.HTTPError) -> bool:
    """Whether a failed exchange says the worker is gone: no connection (refused, or not made in
    time), or one that broke. A timeout on a connection already made only says it is slow."""
    if isinstance(e, httpx.TimeoutException):
        return isinstance(e, httpx.ConnectTimeout)
    return isinstance(e, httpx.TransportError)


def describe(e: BaseException) -> str:
    """One line for a failed exchange with a worker (httpx's own text is often empty)."""
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
