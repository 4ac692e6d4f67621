"""Cancel a request's work when its client goes away, streaming or not.

A streaming response notices a gone client when a write fails; a non-streaming handler writes
nothing until it is done, so without this it would generate to the end for nobody. Cancelling
the handler's task runs the `finally` of `stream_choices`, which aborts every sub-request, and
the scheduler frees their pages on its next step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, but logs show it


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """The result of `work`, or a 499 response if the client disconnected first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # this handler itself was cancelled: take the work down with it
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    # One cancel can be lost: before Python 3.12, asyncio.wait_for (how the work waits for the
    # engine's output) returns an item that arrived in the same tick instead of raising, and the
    # work then generates to the end. So cancel until it has stopped.
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if not task.cancelled():
        task.exception()  # retrieved (it ended on its own meanwhile): nobody is there to read it
    log.info("client disconnected from %s; its request was aborted", request.url.path)
    return Response(status_code=CLIENT_CLOSED)
