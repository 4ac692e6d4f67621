"""Forwarding one OpenAI request to a worker picked by the policy, with retries while nothing
has reached the client yet.

A try goes on to the next worker the policy picks (among those not yet tried) when the worker
cannot be reached or its connection breaks before anything was relayed (the worker is also taken
out until a health check passes), or when it answers 5xx (a live worker: its health is left to the
checks). A worker that times out once it has the request is slow, not gone: the client gets a 504
naming it, and the worker stays in (`HTTPRouter.fault`). A 4xx is the client's answer, passed
through. A stream is committed to its worker at its first event, then relayed event by event,
bytes unchanged (gateway/relay.py); if the worker breaks or stalls after that the client gets an SSE
error event and `[DONE]`. A prompt's pages are pending at its worker while the request runs, and
stored there only once the worker answers 2xx (or streams an event): a refusal leaves no credit
behind.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping

import httpx
from fastapi.responses import Response

from shardserve.gateway.relay import Fault, Relay, RelayResponse, sse_error
from shardserve.gateway.request_key import BadRequest, KeyMaker, RouteKey, parse_json_object
from shardserve.gateway.workers import WorkerPool, describe, is_down
from shardserve.http_common import error_response
from shardserve.kvcache.pages import page_hashes
from shardserve.router.policy import NoReplica, Router

# Not forwarded: they describe this hop's connection, not the request. The client's
# accept-encoding is replaced by identity (TO_WORKER), not just dropped: httpx would then ask for
# gzip itself, and a compressing worker's stream would no longer be the bytes the worker wrote.
# Not forwarded: hop-by-hop headers, and the client's Authorization (the router's own key; the
# workers get theirs from the router's client, --worker-api-key).
HOP_HEADERS = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding", "authorization"}
TO_WORKER = {"accept-encoding": "identity"}

__all__ = ["HTTPRouter", "sse_error"]  # sse_error: callers know it from here


class GiveUp(Exception):
    """A try that ends the request with `response`: another worker would not do better."""

    def __init__(self, response: Response):
        super().__init__(response.status_code)
        self.response = response


def route_excluding(router: Router, excluded: set[int], rid: str, pages: list[bytes], prompt_len: int,
                    max_tokens: int | None) -> int:
    """`router.route` among its healthy replicas outside `excluded`, which are marked down for
    the call only (it is synchronous: no other task sees them down)."""
    hidden = [r for r in router.replicas if r.index in excluded and r.healthy]
    for r in hidden:
        r.healthy = False
    try:
        # Pending, not stored: a worker that refuses the request must not keep the credit.
        return router.route(rid, pages, prompt_len, max_tokens, confirmed=False)
    finally:
        for r in hidden:
            r.healthy = True


class HTTPRouter:
    """Forwards each request to one worker of `pool`. The hooks `prepare`, `_pick`, `credit` and
    `release` are where PD mode (gateway/pd.py) differs: it picks a prefill instance as well."""

    no_worker = "no healthy worker to send the request to"  # the 503 when every worker is down or tried

    def __init__(self, pool: WorkerPool, keys: KeyMaker, client: httpx.AsyncClient, page_size: int):
        self.pool, self.keys, self.client, self.page_size = pool, keys, client, page_size
        self.router = pool.router
        self.relays: set[Relay] = set()  # streams being relayed
        self.tasks: set[asyncio.Task] = set()  # requests not yet answered (see standalone.py)
        self.stopping = False

    def pools(self) -> dict[str, WorkerPool]:
        """The pools /health reports, by the name it gives each."""
        return {"workers": self.pool}

    def render_metrics(self) -> bytes:
        return self.pool.render()

    def prepare(self, rid: str, pages: list[bytes], key: RouteKey) -> dict[str, str] | Response:
        """Before the first try: headers to add to every try, or the answer that ends the request."""
        return {}

    def credit(self, rid: str, i: int, pages: list[bytes]) -> None:
        """Worker `i` answered 2xx (or streamed an event): the prompt's pages are in its cache now."""
        self.router.replicas[i].prefixes.store(pages)

    def release(self, rid: str) -> None:
        """The request has ended, however it ended: its load and pending pages go."""
        self.router.finish(rid)

    def cut_all(self, reason: str) -> int:
        """End every request in flight with `reason` (a 503, or an error event on a stream)."""
        self.stopping = True
        for relay in list(self.relays):
            relay.cut(reason)
        for task in list(self.tasks):
            task.cancel()
        return len(self.relays) + len(self.tasks)

    def fault(self, i: int, e: httpx.HTTPError, when: str = "") -> Fault:
        """Count a failed exchange with worker `i` and say what it means. No connection, or one
        that broke, means the worker is gone (crashed, restarting): out until a check passes. A
        timeout once connected means only that it is slow (a long prefill, a full queue): taking it
        out would wipe what the router knows of its cache, and the next worker may well be as slow,
        so the request ends there with a 504."""
        url, reason, at = self.pool.urls[i], describe(e), f" {when}" if when else ""
        if is_down(e):
            self.pool.failed(i, f"{reason}{at}")
            return Fault(True, 503, f"worker {url} failed{at}: {reason}")
        self.pool.series(self.pool.metrics.errors, i).inc()
        if isinstance(e, httpx.TimeoutException):
            limit = self.client.timeout.read
            waited = f" for {limit:g} s, the router's request timeout" if limit is not None else ""
            return Fault(False, 504, f"worker {url} sent nothing{at}{waited} ({reason})")
        return Fault(False, 502, f"worker {url} sent an unreadable answer{at}: {reason}")

    def _pick(self, rid: str, pages: list[bytes], key: RouteKey, tried: set[int]) -> int:
        """The policy's choice among healthy workers not yet tried (a health check may have
        marked one of those healthy again meanwhile; one try per worker is enough)."""
        return route_excluding(self.router, tried, rid, pages, len(key.ids), key.max_tokens)

    async def forward(self, raw: bytes, client_headers: Mapping[str, str], path: str, kind: str) -> Response:
        """Route and forward the POST body `raw` to `path`; `kind` ("completions" or "chat") says
        which field is the prompt."""
        try:
            key = await self.keys.key(kind, parse_json_object(raw))
        except BadRequest as e:
            return error_response(400, e.message, e.param)
        # As the in-server router: the last prompt token is always recomputed, so a page ending on
        # it is never a cache hit, and the workers' pages are digested the same way.
        pages = page_hashes(key.ids[: max(len(key.ids) - 1, 0)], self.page_size)
        headers = {k: v for k, v in client_headers.items() if k.lower() not in HOP_HEADERS} | TO_WORKER
        rid = uuid.uuid4().hex
        tried: set[int] = set()
        failures: list[str] = []
        last_5xx: Response | None = None
        relayed = False
        try:
            extra = self.prepare(rid, pages, key)
            if isinstance(extra, Response):
                return extra
            # Ours replace the client's: a client must not name, say, the prefill instance itself.
            headers = {k: v for k, v in headers.items() if k.lower() not in {e.lower() for e in extra}} | extra
            while True:
                try:
                    i = self._pick(rid, pages, key, tried)
                except NoReplica:
                    if last_5xx is not None:  # every worker is up but refused it: say why, as they did
                        return last_5xx
                    tried_text = f" (tried {'; '.join(failures)})" if failures else ""
                    return error_response(503, f"{self.no_worker}{tried_text}")
                tried.add(i)
                try:
                    result = await self._try(rid, i, path, raw, headers)
                except GiveUp as e:
                    return e.response
                if isinstance(result, Relay):
                    self.credit(rid, i, pages)  # its first event: the prompt is in
                    relayed = True
                    self.relays.add(result)
                    return RelayResponse(result)
                if isinstance(result, Response) and result.status_code < 500:
                    if result.status_code < 300:
                        self.credit(rid, i, pages)
                    return result
                if isinstance(result, Response):
                    last_5xx = result
                    failures.append(f"{self.pool.urls[i]}: answered {result.status_code}")
                else:
                    failures.append(f"{self.pool.urls[i]}: {result}")
                self.router.finish(rid)  # withdraws its pending pages; route() counts it again on the next worker
        finally:
            if not relayed:
                self.release(rid)

    async def _try(self, rid: str, i: int, path: str, raw: bytes, headers: dict) -> Response | Relay | str:
        """One try at worker `i`: its answer (a Relay for a stream), or why it failed and may be
        retried (str); raises GiveUp when it failed in a way another worker would not mend."""
        self.pool.series(self.pool.metrics.requests, i).inc()
        started = time.monotonic()
        resp: httpx.Response | None = None
        try:
            req = self.client.build_request("POST", self.pool.urls[i] + path, content=raw, headers=headers)
            resp = await self.client.send(req, stream=True)
            is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
            if resp.status_code < 300 and is_sse:
                relay = Relay(self, rid, i, resp, started)
                await relay.first()
                resp = None  # the relay owns the connection now
                return relay
            content = await resp.aread()
        except httpx.HTTPError as e:
            fault = self.fault(i, e)
            if fault.down:
                return describe(e)
            raise GiveUp(error_response(fault.status, fault.message)) from None
        finally:
            if resp is not None:
                await resp.aclose()
        answer = Response(content, resp.status_code, media_type=resp.headers.get("content-type"))
        if resp.status_code >= 500:
            # Alive but refusing (overloaded, or this request broke it): try elsewhere, but leave its
            # health to the checks, or one bad request could take every worker out at once.
            self.pool.series(self.pool.metrics.errors, i).inc()
        else:
            self.pool.series(self.pool.metrics.latency, i).observe(time.monotonic() - started)
        return answer
