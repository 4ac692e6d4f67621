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
    """Per-worker counters in a registry of their own (the router serves only these)."""

    def __init__(self, urls: list[str]):
        self.registry = reg = CollectorRegistry()
        w = ["worker"]
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
        for url in urls:  # every series exists from the start, at 0
            for metric in (self.requests, self.errors, self.latency):
                metric.labels(url)


class WorkerPool:
    def __init__(self, urls: list[str], router: Router, client: httpx.AsyncClient, check_timeout: float):
        self.urls = [u.rstrip("/") for u in urls]
        self.router, self.client, self.check_timeout = router, client, check_timeout
        self.metrics = WorkerMetrics(self.urls)

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
            log.info("worker %s is healthy again; routing to it", self.urls[i])
        else:
            # What it held may be gone when it comes back (a restart starts with an empty cache):
            # believe nothing rather than pull requests to pages it no longer has.
            replica.prefixes.clear()
            log.warning("worker %s is down (%s); not routing to it", self.urls[i], reason)

    def failed(self, i: int, reason: str) -> None:
        """Worker `i` is gone (see `is_down`): count it and stop routing there until a check passes."""
        self.metrics.errors.labels(self.urls[i]).inc()
        self.mark(i, False, reason)

    async def check(self, i: int) -> None:
        try:
            r = await self.client.get(self.urls[i] + "/health", timeout=self.check_timeout)
            ok, reason = r.status_code == 200, f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, reason = False, describe(e)
        self.mark(i, ok, reason)

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

    def render(self) -> bytes:
        m = self.metrics
        for url, r in zip(self.urls, self.router.replicas):
            m.in_flight.labels(url).set(r.in_flight)
            m.healthy.labels(url).set(1 if r.healthy else 0)
            m.load.labels(url).set(r.load)
            m.prompt_tokens.labels(url).set(r.prompt_tokens)
            m.tree_pages.labels(url).set(len(r.prefixes))
        return generate_latest(m.registry)


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
