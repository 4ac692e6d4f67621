"""Forwarding one OpenAI request to a worker picked by the policy, with retries while nothing
has reached the client yet.

A try fails when the worker cannot be reached, times out, answers 5xx, or (streaming) breaks
before its first event; the request then goes to the next worker the policy picks among those
not yet tried. Each failure but a 5xx also marks the worker down until a health check passes
(a 5xx comes from a live worker). A 4xx is the client's answer, passed through as it is. A
streamed response is committed to its worker once the first event arrives, and from then on is
relayed event by event, bytes unchanged; if the worker breaks after that the client gets one SSE
error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shardserve.kvcache.pages import page_hashes
from shardserve.openai_errors import error_body
from shardserve.router.policy import NoReplica
from shardserve.router.request_key import BadRequest, KeyMaker, RouteKey, parse_json_object
from shardserve.router.workers import WorkerPool, describe

# Not forwarded: they describe this hop's connection, not the request. accept-encoding is
# dropped so workers answer uncompressed and streamed bytes pass through as they are.
HOP_HEADERS = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding"}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status)


def sse_error(message: str, status: int = 503) -> bytes:
    return f"data: {json.dumps(error_body(message, status))}\n\ndata: [DONE]\n\n".encode()


def events_end(buf: bytes) -> int:
    """Length of the complete SSE events at the front of `buf` (0 if none has ended yet)."""
    lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


class Relay:
    """One worker's SSE response on its way to the client, whole events at a time (so a worker
    that breaks mid-event never leaves half an event before the error event)."""

    def __init__(self, owner: HTTPRouter, rid: str, worker: int, resp: httpx.Response, started: float):
        self.owner, self.rid, self.worker, self.resp, self.started = owner, rid, worker, resp, started
        self._chunks = resp.aiter_raw()
        self._buf = b""
        self._first = b""
        self.completed = self.closed = False
        self._cut: str | None = None  # why the router itself ends this stream (shutting down)
        self._reader: asyncio.Task | None = None  # the task while it waits on the worker, else None

    async def _next_events(self) -> bytes:
        """The next complete events (or the unterminated tail at the end; b"" once over)."""
        while (cut := events_end(self._buf)) == 0:
            try:
                chunk = await anext(self._chunks)
            except StopAsyncIteration:
                tail, self._buf = self._buf, b""
                return tail
            self._buf += chunk
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out

    async def first(self) -> None:
        """Wait for the first event; raises httpx.HTTPError if the worker breaks before it."""
        self._first = await self._next_events()

    async def events(self) -> AsyncIterator[bytes]:
        out = self._first
        while out:
            yield out
            if self._cut is not None:
                yield sse_error(self._cut)
                return
            try:
                self._reader = asyncio.current_task()
                out = await self._next_events()
            except asyncio.CancelledError:
                if self._cut is None:
                    raise
                # Our own cancel (see `cut`), as asyncio.timeout does it: not the task's end.
                task = asyncio.current_task()
                if task is not None and hasattr(task, "uncancel"):
                    task.uncancel()
                yield sse_error(self._cut)
                return
            except httpx.HTTPError as e:
                url = self.owner.pool.urls[self.worker]
                reason = describe(e)
                self.owner.pool.failed(self.worker, f"stream broke: {reason}")
                yield sse_error(f"worker {url} failed mid-stream: {reason}")
                return
            finally:
                self._reader = None
        self.completed = True

    def cut(self, reason: str) -> None:
        """End the stream with an error event and [DONE], now if it is waiting on its worker,
        else once the event being written is out (cancelling a write would truncate it)."""
        self._cut = reason
        if self._reader is not None:
            self._reader.cancel()

    async def close(self) -> None:
        """Release the request (idempotent): policy load, latency, and the worker connection,
        whose closing makes a worker abort a stream nobody reads any more."""
        if self.closed:
            return
        self.closed = True
        self.owner.relays.discard(self)
        self.owner.router.finish(self.rid)  # bookkeeping first: the await below may be cut short
        if self.completed:
            url = self.owner.pool.urls[self.worker]
            self.owner.pool.metrics.latency.labels(url).observe(time.monotonic() - self.started)
        await self.resp.aclose()


class RelayResponse(StreamingResponse):
    """A StreamingResponse that closes its relay however it ends: done, client gone, or
    cancelled (even before the body iterator ever started, when its own `finally` cannot run)."""

    def __init__(self, relay: Relay):
        super().__init__(relay.events(), status_code=relay.resp.status_code, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.relay = relay

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.close()


class HTTPRouter:
    def __init__(self, pool: WorkerPool, keys: KeyMaker, client: httpx.AsyncClient, page_size: int):
        self.pool, self.keys, self.client, self.page_size = pool, keys, client, page_size
        self.router = pool.router
        self.relays: set[Relay] = set()  # streams being relayed
        self.tasks: set[asyncio.Task] = set()  # requests not yet answered (see standalone.py)
        self.stopping = False

    def cut_all(self, reason: str) -> int:
        """End every request in flight with `reason` (a 503, or an error event on a stream)."""
        self.stopping = True
        for relay in list(self.relays):
            relay.cut(reason)
        for task in list(self.tasks):
            task.cancel()
        return len(self.relays) + len(self.tasks)

    def _pick(self, rid: str, pages: list[bytes], key: RouteKey, tried: set[int]) -> int:
        """The policy's choice among healthy workers not yet tried (a health check may have
        marked one of those healthy again meanwhile; one try per worker is enough)."""
        hidden = [r for r in self.router.replicas if r.index in tried and r.healthy]
        for r in hidden:
            r.healthy = False
        try:  # synchronous: no other task sees the hidden workers as down
            return self.router.route(rid, pages, len(key.ids), key.max_tokens, confirmed=True)
        finally:
            for r in hidden:
                r.healthy = True

    async def forward(self, raw: bytes, client_headers: Mapping[str, str], path: str, kind: str) -> Response:
        """Route and forward the POST body `raw` to `path`; `kind` ("completions" or "chat") says
        which field is the prompt."""
        try:
            key = await self.keys.key(kind, parse_json_object(raw))
        except BadRequest as e:
            return error_response(400, e.message, e.param)
        pages = page_hashes(key.ids, self.page_size)
        headers = {k: v for k, v in client_headers.items() if k.lower() not in HOP_HEADERS}
        rid = uuid.uuid4().hex
        tried: set[int] = set()
        failures: list[str] = []
        last_5xx: Response | None = None
        relayed = False
        try:
            while True:
                try:
                    i = self._pick(rid, pages, key, tried)
                except NoReplica:
                    if last_5xx is not None:  # every worker is up but refused it: say why, as they did
                        return last_5xx
                    tried_text = f" (tried {'; '.join(failures)})" if failures else ""
                    return error_response(503, f"no healthy worker to send the request to{tried_text}")
                tried.add(i)
                result = await self._try(rid, i, path, raw, headers)
                if isinstance(result, Relay):
                    relayed = True
                    self.relays.add(result)
                    return RelayResponse(result)
                if isinstance(result, Response) and result.status_code < 500:
                    return result
                if isinstance(result, Response):
                    last_5xx = result
                    failures.append(f"{self.pool.urls[i]}: answered {result.status_code}")
                else:
                    failures.append(f"{self.pool.urls[i]}: {result}")
                self.router.finish(rid)  # route() counts the request again on the next worker
        finally:
            if not relayed:
                self.router.finish(rid)

    async def _try(self, rid: str, i: int, path: str, raw: bytes, headers: dict) -> Response | Relay | str:
        """One try at worker `i`: its answer (a Relay for a stream), or why it failed (str)."""
        url = self.pool.urls[i]
        self.pool.metrics.requests.labels(url).inc()
        started = time.monotonic()
        resp: httpx.Response | None = None
        try:
            req = self.client.build_request("POST", url + path, content=raw, headers=headers)
            resp = await self.client.send(req, stream=True)
            is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
            if resp.status_code < 300 and is_sse:
                relay = Relay(self, rid, i, resp, started)
                await relay.first()
                resp = None  # the relay owns the connection now
                return relay
            content = await resp.aread()
        except httpx.HTTPError as e:
            reason = describe(e)
            self.pool.failed(i, reason)  # unreachable, timed out, or broke: take it out until a check passes
            return reason
        finally:
            if resp is not None:
                await resp.aclose()
        answer = Response(content, resp.status_code, media_type=resp.headers.get("content-type"))
        if resp.status_code >= 500:
            # Alive but refusing (overloaded, or this request broke it): try elsewhere, but leave its
            # health to the checks, or one bad request could take every worker out at once.
            self.pool.metrics.errors.labels(url).inc()
        else:
            self.pool.metrics.latency.labels(url).observe(time.monotonic() - started)
        return answer
