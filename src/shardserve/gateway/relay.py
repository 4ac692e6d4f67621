"""A worker's SSE stream on its way to the client (gateway/http_router.py forwards; this relays):
whole events at a time, ending with an error event and `[DONE]` when the worker breaks or stalls,
or the router cuts it off. The forwarder is known here only as a `RelayOwner`, so this module
sits below http_router.py and imports nothing of it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import httpx
from fastapi.responses import StreamingResponse

from shardserve.openai_errors import error_body

if TYPE_CHECKING:
    from shardserve.gateway.workers import WorkerPool


def sse_error(message: str, status: int = 503) -> bytes:
    return f"data: {json.dumps(error_body(message, status))}\n\ndata: [DONE]\n\n".encode()


def events_end(buf: bytes) -> int:
    """Length of the complete SSE events at the front of `buf` (0 if none has ended yet)."""
    lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


@dataclass(frozen=True)
class Fault:
    """What a failed exchange with a worker means for its request."""

    down: bool  # the worker is gone (taken out): a request nothing of which was relayed may go elsewhere
    status: int  # else the client's answer (on a stream, the error event's code)
    message: str


class RelayOwner(Protocol):
    """What a relay needs of the forwarder that opened it (gateway/http_router.py's HTTPRouter)."""

    pool: WorkerPool
    relays: set[Relay]  # the streams being relayed; a relay leaves it when it closes

    def fault(self, i: int, e: httpx.HTTPError, when: str = "") -> Fault: ...

    def release(self, rid: str) -> None: ...


class Relay:
    """One worker's SSE response on its way to the client, whole events at a time (so a worker
    that breaks mid-event never leaves half an event before the error event)."""

    def __init__(self, owner: RelayOwner, rid: str, worker: int, resp: httpx.Response, started: float):
        self.owner, self.rid, self.worker, self.resp, self.started = owner, rid, worker, resp, started
        # Decoded bytes: the worker's own, unchanged, as we ask for identity; a worker that
        # compresses anyway is decoded here rather than relayed without its content-encoding.
        self._chunks = resp.aiter_bytes()
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
        """Wait for the first event; raises httpx.HTTPError if the worker breaks or stalls before it."""
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
                fault = self.owner.fault(self.worker, e, "mid-stream")
                yield sse_error(fault.message, fault.status)
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
        self.owner.release(self.rid)  # bookkeeping first: the await below may be cut short
        if self.completed:
            pool = self.owner.pool
            pool.series(pool.metrics.latency, self.worker).observe(time.monotonic() - self.started)
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
