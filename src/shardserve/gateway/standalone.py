"""`shardserve router`: an HTTP router in front of OpenAI-compatible servers (ours or another
engine's).

    client --HTTP--> router (FastAPI + uvicorn, one shared httpx client) --HTTP--> worker URLs

POST /v1/completions and /v1/chat/completions are routed by the policy (router/policy.py) on the
prompt's page digests and forwarded (gateway/http_router.py); /v1/models is the first healthy
worker's; /health and /metrics are the router's own. There are no cache events from foreign
workers, so a request's pages are credited to its worker once it answers 2xx (or streams its first
event), and an LRU bound per worker (--max-tree-pages) stands in for the worker's eviction.
With --prefill and --decode instead of --worker-urls it fronts disaggregated prefill and decode
instances (gateway/pd.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Awaitable
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from shardserve.gateway.http_router import HTTPRouter
from shardserve.gateway.pd import DECODE_POLICY, make_pd_router
from shardserve.gateway.request_key import KeyMaker
from shardserve.gateway.workers import WorkerPool, describe
from shardserve.http_common import answer_errors, cancel_on_disconnect, error_response, require_api_key
from shardserve.ipc.sockets import listen_socket
from shardserve.router.policy import Router, Thresholds

log = logging.getLogger("shardserve.router")

CHARS_PER_TOKEN = 4.0  # without a tokenizer: English text's usual ratio
SHUTDOWN_GRACE_S = 5  # in-flight requests may finish this long after a stop signal, then are cut off
SHUTTING_DOWN = "the router is shutting down"


async def _unless_cut(work: Awaitable[Any], fwd: HTTPRouter) -> Any:
    """`work`'s answer, or a 503 if a shutdown cut it off (`HTTPRouter.cut_all` cancels every
    request in `fwd.tasks`, where `cancel_on_disconnect` keeps it until it is answered)."""
    try:
        return await work
    except asyncio.CancelledError:
        if fwd.stopping:
            return error_response(503, SHUTTING_DOWN)
        raise


class _Server(uvicorn.Server):
    """uvicorn, plus: requests still in flight SHUTDOWN_GRACE_S after the stop signal end with a
    clean error (503, or an error event then [DONE] on a stream) rather than a cut connection."""

    def __init__(self, config: uvicorn.Config, fwd: HTTPRouter):
        super().__init__(config)
        self.fwd = fwd
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit and self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.call_later, SHUTDOWN_GRACE_S, self._cut_off)
        super().handle_exit(sig, frame)

    def _cut_off(self) -> None:
        cut = self.fwd.cut_all(SHUTTING_DOWN)
        log.info("shutting down: %d request%s still in flight cut off", cut, "" if cut == 1 else "s")


def build_app(fwd: HTTPRouter, health_interval: float, api_key: str = "", metrics_require_key: bool = False) -> FastAPI:
    """`api_key`: what clients must send (as the server's --api-key; /health and /metrics stay open
    unless `metrics_require_key`)."""
    pool = fwd.pool  # the workers requests are POSTed to (in PD mode the decode instances)
    pools = fwd.pools()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await asyncio.gather(*(p.check_all() for p in pools.values()))  # know who is up before the first request
        checks = [asyncio.create_task(p.run(health_interval)) for p in pools.values()]
        try:
            yield
        finally:
            for task in checks:
                task.cancel()
            for task in checks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await fwd.client.aclose()
            fwd.keys.close()

    app = FastAPI(title="shardserve router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    require_api_key(app, api_key, metrics_require_key)
    answer_errors(app)

    async def proxy(request: Request, path: str, kind: str) -> Response:
        raw = await request.body()  # before watching for the disconnect, which reads the same channel
        if fwd.stopping:
            return error_response(503, SHUTTING_DOWN)
        return await cancel_on_disconnect(request, _unless_cut(fwd.forward(raw, request.headers, path, kind), fwd),
                                          fwd.tasks)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy(request, "/v1/completions", "completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await proxy(request, "/v1/chat/completions", "chat")

    @app.get("/v1/models")
    async def models():
        failures = []
        for i, url in enumerate(pool.urls):
            if not pool.is_healthy(i):
                continue
            try:
                r = await fwd.client.get(url + "/v1/models", timeout=pool.check_timeout)
            except httpx.HTTPError as e:
                failures.append(f"{url}: {describe(e)}")
                continue
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        detail = f" ({'; '.join(failures)})" if failures else ""
        return error_response(503, f"no healthy {pool.noun} to list models{detail}")

    @app.get("/health")
    @app.get("/ping")  # what SageMaker's and vLLM's probes call; as /health
    @app.post("/ping")
    async def health():
        states = {name: {url: "healthy" if p.is_healthy(i) else "unhealthy" for i, url in enumerate(p.urls)}
                  for name, p in pools.items()}
        missing = [p for p in pools.values() if not p.any_healthy()]
        if not missing:
            return JSONResponse({"status": "ok", **states})
        return error_response(503, "; ".join(f"no healthy {p.noun}: {', '.join(p.urls)}" for p in missing))

    @app.get("/metrics")
    async def metrics():
        return Response(fwd.render_metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def load_tokenizer_for(model: str | None):
    """The model's tokenizer, or None for character mode."""
    if model is None:
        return None
    from shardserve.loader.model_path import resolve_checkpoint
    from shardserve.loader.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_checkpoint(model))
    if tok is None:
        log.warning("%s ships no tokenizer; routing on characters", model)
    return tok


def make_client(num_workers: int, request_timeout: float, worker_key: str = "") -> httpx.AsyncClient:
    # One client for every worker. No cap on connections: each in-flight request holds one, and
    # a pool wait would fail healthy workers; the workers bound their own queues. The read
    # timeout is the longest a worker may stay silent (between stream events, or before a
    # non-streamed answer). trust_env=False: a proxy from the environment must not sit between
    # the router and its workers.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64 * num_workers, keepalive_expiry=30)
    timeout = httpx.Timeout(request_timeout, connect=min(request_timeout, 5.0))
    # The workers' key goes on every request to them (health checks too); the client's own
    # Authorization never reaches a worker (http_router.HOP_HEADERS drops it).
    headers = {"authorization": f"Bearer {worker_key}"} if worker_key else None
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False, headers=headers)


def build_forwarder(args: argparse.Namespace, tokenizer) -> tuple[HTTPRouter, str]:
    """The forwarder the parsed `router` flags ask for (plain, or PD with --prefill and --decode),
    and what the startup line says of it."""
    thresholds = Thresholds(balance_abs_tokens=args.balance_abs_tokens, balance_rel=args.balance_rel,
                            load_weight=args.load_weight)

    def router(n: int, policy: str) -> Router:
        # Without a tokenizer prompts are characters: about 4 to a token in English text, so loads
        # and thresholds keep their meaning in tokens.
        return Router(n, policy, args.page_size, thresholds, max_pages=args.max_tree_pages,
                      units_per_token=1.0 if tokenizer is not None else CHARS_PER_TOKEN)

    check_timeout = max(1.0, min(5.0, 2 * args.health_interval))
    if args.prefill:
        client = make_client(len(args.prefill) + len(args.decode), args.request_timeout, args.worker_api_key)
        fwd = make_pd_router(args.prefill, args.decode, router(len(args.prefill), args.policy),
                             router(len(args.decode), DECODE_POLICY), KeyMaker(tokenizer), client, args.page_size,
                             check_timeout)
        return fwd, (f"in prefill/decode mode: prefill by {args.policy} over {', '.join(fwd.prefill.urls)}; "
                     f"decode by {DECODE_POLICY} over {', '.join(fwd.pool.urls)}")
    client = make_client(len(args.worker_urls), args.request_timeout, args.worker_api_key)
    pool = WorkerPool(args.worker_urls, router(len(args.worker_urls), args.policy), client, check_timeout)
    fwd = HTTPRouter(pool, KeyMaker(tokenizer), client, args.page_size)
    return fwd, f"by {args.policy} over {', '.join(pool.urls)}"


def run_router(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM (exit 0); 1 when the port cannot be had."""
    try:
        sock = listen_socket(args.host, args.port)
    except OSError as e:
        print(f"shardserve: error: {e}", file=sys.stderr)
        return 1
    tokenizer = load_tokenizer_for(args.model)
    fwd, described = build_forwarder(args, tokenizer)
    # uvicorn's own limit comes later: by then every request has had its clean error.
    config = uvicorn.Config(build_app(fwd, args.health_interval, args.api_key, args.metrics_require_key),
                            log_level=args.log_level,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S + 3)
    server = _Server(config, fwd)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health check and forwarded request
    log.info("routing on http://%s:%d %s (keys: %s)", args.host, args.port, described,
             "token ids" if tokenizer is not None else "characters")
    # uvicorn re-raises the stop signal once it has shut down; a no-op handler lets the process
    # exit 0 after a clean stop instead of dying by that signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    asyncio.run(server.serve(sockets=[sock]))
    return 0
