"""What the server's app (server/app.py) and the standalone router's (gateway/standalone.py)
share: the API-key check, OpenAI error bodies for errors no route handled, and cancelling a
request's work when its client goes away.

It sits below both (it imports only openai_errors.py), so neither imports the other for these.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from shardserve.openai_errors import ANTHROPIC_PATHS, error_body, key_ok, unauthorized_body

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, but logs show it
OPEN_PATHS = ("/health", "/ping", "/metrics")  # Prometheus and load balancers probe these without a key


# Deeper bodies are refused: what the parser accepts (~1,000 levels) some later step (a schema's
# compilation, a chat template, a message's encoding) could still fail on, as an internal error.
MAX_DEPTH = 128


class BodyError(ValueError):
    """A request body that is not a JSON object this server reads (answered with a 400); `param`:
    the field at fault, where one is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


INT64 = 2**63  # msgpack, which carries a request to the engine, takes nothing wider


def _no_constant(name: str):
    raise BodyError(f"malformed JSON body: {name} is not a JSON number")


def json_object(raw: bytes) -> dict:
    """The body as a JSON object, or BodyError saying why not (malformed, not an object, too
    deep, a number no field could hold)."""
    deep = f"the request body nests arrays or objects more than {MAX_DEPTH} deep"
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:  # the parser recurses once per level of nesting
        raise BodyError(deep) from None
    except BodyError:
        raise
    except ValueError as e:  # malformed (JSONDecodeError), not UTF-8, or an integer of > 4300 digits
        raise BodyError(f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise BodyError("the request body must be a JSON object")
    problem = _shape_problem(data)
    if problem is not None:
        raise BodyError(deep) if problem == "deep" else BodyError(*problem)
    return data


def _shape_problem(data: object) -> str | tuple[str, str] | None:
    """"deep" where `data` nests lists or dicts more than MAX_DEPTH deep, else (what is wrong,
    the field) for a number no field holds (an integer beyond 64 bits, a float that overflowed
    to infinity), else None. Walked without recursion."""
    todo: list[tuple[object, int, tuple]] = [(data, 1, ())]
    while todo:
        item, depth, path = todo.pop()
        if depth > MAX_DEPTH:
            return "deep"
        children = item.items() if isinstance(item, dict) else enumerate(item) if isinstance(item, list) else ()
        for key, c in children:
            if isinstance(c, dict | list):
                todo.append((c, depth + 1, (*path, key)))
            elif (why := _number_problem(c)) is not None:
                field = ".".join(map(str, (*path, key)))
                return f"invalid field {field!r}: {why}", field
    return None


def _number_problem(value: object) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and not -INT64 <= value < INT64:
        return f"integer {value} is outside the 64-bit range"
    if isinstance(value, float) and not math.isfinite(value):
        return "number out of range"
    return None


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status)


def require_api_key(app: FastAPI, api_key: str, metrics_require_key: bool = False) -> None:
    """Answer 401 to requests without `Authorization: Bearer <api_key>` ("" = open to all);
    OPEN_PATHS stay open unless `metrics_require_key`."""
    if api_key:
        app.add_middleware(_KeyGate, api_key=api_key, metrics_require_key=metrics_require_key)


class _KeyGate:
    """Plain ASGI middleware: Starlette's `@app.middleware("http")` (BaseHTTPMiddleware) would
    pass every streamed chunk through a task and a memory stream of its own, which costs the API
    process as much CPU as the rest of a token's way through it."""

    def __init__(self, app: ASGIApp, api_key: str, metrics_require_key: bool):
        self.app, self.api_key, self.metrics_require_key = app, api_key, metrics_require_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            request = Request(scope)
            guarded = self.metrics_require_key or request.url.path not in OPEN_PATHS
            if guarded and not key_ok(request.headers, self.api_key):
                anthropic = request.url.path.startswith(ANTHROPIC_PATHS)
                refused = JSONResponse(unauthorized_body(anthropic), 401, headers={"WWW-Authenticate": "Bearer"})
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


def answer_errors(app: FastAPI) -> None:
    """OpenAI error bodies for Starlette's own HTTP errors (404, 405, ...) and, as a 500, for any
    exception a route let through."""

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):
        # The traceback goes to the log; the client gets one plain line, no class names.
        log.exception("internal error")
        detail = " ".join(str(e).split())
        return error_response(500, f"internal error: {detail}" if detail else "internal error")


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[Any], tasks: set[asyncio.Task] | None = None) -> Any:
    """The result of `work`, or a 499 response if the client disconnected first.

    A streaming response notices a gone client when a write fails; a non-streaming handler
    writes nothing until it is done, so without this it would work to the end for nobody.
    Cancelling the work aborts it downstream: in the server, the `finally` of `stream_choices`
    aborts every sub-request; in the router, closing the worker connection makes the worker abort.
    `tasks` (the standalone router's) holds the work's task until it is answered, so that a
    shutdown can cancel it."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    if tasks is not None:
        tasks.add(task)
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # this handler itself was cancelled: take the work down with it
        task.cancel()
        watcher.cancel()
        raise
    finally:
        if tasks is not None:
            tasks.discard(task)
    watcher.cancel()
    if task.done():
        return task.result()
    await _cancel(task)
    log.info("client disconnected from %s; its request was aborted", request.url.path)
    return Response(status_code=CLIENT_CLOSED)


async def _cancel(task: asyncio.Task) -> None:
    # One cancel can be lost: before Python 3.12, asyncio.wait_for (how the server's work waits
    # for the engine's output) returns an item that arrived in the same tick instead of raising,
    # and the work then runs to the end. So cancel until it has stopped.
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if not task.cancelled():
        task.exception()  # retrieved (it ended on its own meanwhile): nobody is there to read it
