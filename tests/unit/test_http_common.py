"""http_common.py, which the server's app and the standalone router's share: the API-key check,
OpenAI error bodies for errors no route handled, and cancelling work whose client went away."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Counter
from starlette.middleware.base import BaseHTTPMiddleware

from shardserve.http_common import CLIENT_CLOSED, answer_errors, cancel_on_disconnect, require_api_key
from shardserve.server.metrics import CountResponses


def _app(api_key: str = "", metrics_require_key: bool = False) -> FastAPI:
    app = FastAPI()
    require_api_key(app, api_key, metrics_require_key)
    answer_errors(app)

    @app.get("/health")
    @app.get("/ping")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    @app.get("/boom")
    async def boom():
        raise ValueError("boom")

    return app


def _counted_app(api_key: str) -> tuple[FastAPI, Counter]:
    app = _app(api_key)
    counter = Counter("answers", "test", ["endpoint", "status"], registry=CollectorRegistry())
    app.add_middleware(CountResponses, counter=counter)

    @app.get("/v1/stream/{n}")
    async def stream(n: int):
        return StreamingResponse((f"data: {i}\n\n" async for i in _count_to(n)), media_type="text/event-stream")

    return app, counter


async def _count_to(n: int):
    for i in range(n):
        yield i


def _get(app: FastAPI, path: str, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}

    async def go():
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get(path, headers=headers)

    return asyncio.run(go())


@pytest.mark.parametrize("metrics_require_key", [False, True])
def test_api_key(metrics_require_key):
    app = _app("sk", metrics_require_key)
    refused = _get(app, "/v1/models", "wrong")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert refused.headers["www-authenticate"] == "Bearer"
    assert _get(app, "/v1/models", "sk").status_code == 200
    assert _get(app, "/health").status_code == (401 if metrics_require_key else 200)
    assert _get(app, "/ping").status_code == (401 if metrics_require_key else 200)
    assert _get(_app(), "/v1/models").status_code == 200  # no key set: open


def test_middleware_is_plain_asgi_streams_whole_and_counts_every_answer():
    """Neither the key check nor the counting is a BaseHTTPMiddleware, which would pass each
    streamed chunk through a task and a memory stream of its own."""
    app, counter = _counted_app("sk")
    assert app.user_middleware and not any(issubclass(m.cls, BaseHTTPMiddleware) for m in app.user_middleware)
    streamed = _get(app, "/v1/stream/300", "sk")
    assert streamed.status_code == 200 and streamed.text == "".join(f"data: {i}\n\n" for i in range(300))
    assert _get(app, "/v1/stream/3").status_code == 401
    assert _get(app, "/boom", "sk").status_code == 500
    assert _get(app, "/nothing", "sk").status_code == 404
    counts = {(s.labels["endpoint"], s.labels["status"]): s.value for s in counter.collect()[0].samples
              if s.name == "answers_total"}
    assert counts == {("/v1/stream/{n}", "200"): 1, ("unmatched", "401"): 1, ("/boom", "500"): 1,
                      ("unmatched", "404"): 1}


def test_unhandled_errors_get_openai_bodies():
    missing = _get(_app(), "/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "404"
    boom = _get(_app(), "/boom")
    assert boom.status_code == 500 and boom.json()["error"]["message"] == "internal error: boom"  # no class names


def _request(gone: asyncio.Event) -> SimpleNamespace:
    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    return SimpleNamespace(receive=receive, url=SimpleNamespace(path="/v1/completions"))


@pytest.mark.parametrize("stubborn", [False, True])
def test_a_disconnect_cancels_the_work(stubborn):
    """`stubborn`: the work ignores its first cancel, as a lost cancel before Python 3.12 does."""
    state = {"cancels": 0, "ended": False}

    async def work():
        try:
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    state["cancels"] += 1
                    if not stubborn or state["cancels"] > 1:
                        raise
        finally:
            state["ended"] = True

    async def go():
        gone, tasks = asyncio.Event(), set()
        answer = asyncio.ensure_future(cancel_on_disconnect(_request(gone), work(), tasks))
        await asyncio.sleep(0.01)
        assert len(tasks) == 1
        gone.set()
        return await asyncio.wait_for(answer, 5), tasks

    response, tasks = asyncio.run(go())
    assert response.status_code == CLIENT_CLOSED and state["ended"] and not tasks
    assert state["cancels"] == (2 if stubborn else 1)


def test_work_that_finishes_first_is_the_answer():
    async def go():
        return await cancel_on_disconnect(_request(asyncio.Event()), asyncio.sleep(0, "done"))

    assert asyncio.run(go()) == "done"
