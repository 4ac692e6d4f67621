"""`shardserve router --prefill URL ... --decode URL ...`: the standalone router in front of
disaggregated prefill and decode instances (as SGLang's PD router).

Per request the router picks a prefill instance by the policy (--policy: cache_aware on the
prompt's page digests by default, as the plain mode picks a worker) and a decode instance by least
outstanding tokens, then POSTs to the decode instance alone, with the header
`X-Shardserve-Prefill: tcp://HOST:PORT` naming the prefill instance's bootstrap address. The decode
instance reserves KV pages, has that prefill instance compute the prompt and ship its KV, and
answers the whole response itself. That answer is relayed, retried (on the next decode instance,
with the same prefill instance) and released exactly as in the plain mode: `PDRouter` is
`HTTPRouter` with its hooks filled in.

Each instance's role is checked with its health: besides /health, `GET /disaggregation` must
answer `{"mode": ROLE, "bootstrap_port": ...}` with the role the command line gave it. A prefill
instance's bootstrap address is known only from that answer, so one never checked is never named.
"""

from __future__ import annotations

import urllib.parse

import httpx
from fastapi.responses import Response

from shardserve.gateway.http_router import HTTPRouter, route_excluding
from shardserve.gateway.request_key import KeyMaker, RouteKey
from shardserve.gateway.workers import WorkerMetrics, WorkerPool, describe
from shardserve.http_common import error_response
from shardserve.router.policy import NoReplica, Router

PREFILL_HEADER = "X-Shardserve-Prefill"
DECODE_POLICY = "least_load"  # a decode instance's work is its outstanding tokens; it holds no prefix to aim for


def bootstrap_address(url: str, port: int) -> str:
    """`tcp://HOST:PORT`, HOST being `url`'s host name (an IPv6 literal keeps its brackets, as
    an address with a port needs them)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class PDPool(WorkerPool):
    """The prefill or the decode instances (`role`). Healthy: /health answers 200 and
    /disaggregation names the mode `role`; a prefill instance's bootstrap address comes from the
    same answer, learnt at each check (a restarted instance may have a new port)."""

    def __init__(self, urls: list[str], router: Router, client: httpx.AsyncClient, check_timeout: float,
                 role: str, metrics: WorkerMetrics):
        super().__init__(urls, router, client, check_timeout, role=role, metrics=metrics)
        self.bootstrap: list[str | None] = [None] * len(self.urls)  # prefill only; None until checked

    async def probe(self, i: int) -> str | None:
        reason = await super().probe(i)
        if reason is None:
            reason = await self._probe_mode(i)
        if reason is not None:
            self.bootstrap[i] = None
        return reason

    async def _probe_mode(self, i: int) -> str | None:
        url, expected = self.urls[i], f"expected mode {self.role!r}"
        try:
            r = await self.client.get(url + "/disaggregation", timeout=self.check_timeout)
        except httpx.HTTPError as e:
            return f"/disaggregation: {describe(e)}"
        if r.status_code != 200:  # 404: a server from before disaggregation, so in mode "null"
            return f"{expected}, but /disaggregation answered {r.status_code}"
        try:
            info = r.json()
        except ValueError:
            info = None
        if not isinstance(info, dict):
            return f"{expected}, but /disaggregation answered no JSON object"
        if info.get("mode") != self.role:
            return f"{expected}, but /disaggregation says mode {info.get('mode')!r}"
        if self.role == "prefill":
            port = info.get("bootstrap_port")
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                return f"/disaggregation names no usable bootstrap_port ({port!r})"
            self.bootstrap[i] = bootstrap_address(url, port)
        return None


class PDRouter(HTTPRouter):
    """`pool` (the instances POSTed to) is the decode pool; `prefill` is the prefill pool."""

    no_worker = "no healthy decode instance to send the request to"

    def __init__(self, prefill: PDPool, decode: PDPool, keys: KeyMaker, client: httpx.AsyncClient, page_size: int):
        super().__init__(decode, keys, client, page_size)
        self.prefill = prefill

    def pools(self) -> dict[str, WorkerPool]:
        return {"prefill": self.prefill, "decode": self.pool}

    def render_metrics(self) -> bytes:
        self.prefill.set_gauges()  # the pools share one registry: the decode pool renders both
        return super().render_metrics()

    def prepare(self, rid: str, pages: list[bytes], key: RouteKey) -> dict[str, str] | Response:
        """Pick the prefill instance (by the policy) and name it to the decode instances."""
        pool = self.prefill
        unknown = {i for i, addr in enumerate(pool.bootstrap) if addr is None}
        try:
            # Its load is the prompt alone (max_tokens 0): the decode tokens are the decode instance's work.
            i = route_excluding(pool.router, unknown, rid, pages, len(key.ids), 0)
        except NoReplica:
            return error_response(503, f"no healthy prefill instance to send the request to "
                                       f"({', '.join(pool.urls)}: see /health)")
        pool.series(pool.metrics.requests, i).inc()
        return {PREFILL_HEADER: pool.bootstrap[i]}

    def _pick(self, rid: str, pages: list[bytes], key: RouteKey, tried: set[int]) -> int:
        # No pages: the decode choice is by load alone (its router is least_load), counting the whole
        # prompt plus max_tokens, and the prefix credit belongs to the prefill instance.
        return super()._pick(rid, [], key, tried)

    def credit(self, rid: str, i: int, pages: list[bytes]) -> None:
        p = self.prefill.router.replica_of(rid)
        if p is not None:
            self.prefill.router.replicas[p].prefixes.store(pages)

    def release(self, rid: str) -> None:
        self.router.finish(rid)
        self.prefill.router.finish(rid)


def make_pd_router(prefill_urls: list[str], decode_urls: list[str], prefill_router: Router, decode_router: Router,
                   keys: KeyMaker, client: httpx.AsyncClient, page_size: int, check_timeout: float) -> PDRouter:
    """A PDRouter over the two pools (`decode_router` should be DECODE_POLICY's)."""
    metrics = WorkerMetrics(roles=True)
    prefill = PDPool(prefill_urls, prefill_router, client, check_timeout, "prefill", metrics)
    decode = PDPool(decode_urls, decode_router, client, check_timeout, "decode", metrics)
    return PDRouter(prefill, decode, keys, client, page_size)
