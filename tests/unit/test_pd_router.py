"""The standalone router's prefill/decode mode (gateway/pd.py), in process as test_http_router.py
does it: the app driven over ASGI against scripted prefill and decode instances
(httpx.MockTransport). Which prefill instance each decode instance is told of, how both are
chosen, health by role, and the `router` command's mode flags."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from test_http_router import EVENTS, SSE, Events  # same folder: pytest puts it on sys.path

from shardserve.cli.main import build_parser, main
from shardserve.gateway.http_router import HTTPRouter
from shardserve.gateway.pd import PREFILL_HEADER, PDRouter, bootstrap_address, make_pd_router
from shardserve.gateway.request_key import KeyMaker
from shardserve.gateway.standalone import build_app, build_forwarder
from shardserve.router.policy import Router

LONG = "the same long system prompt, many pages of it, " * 4  # page size 4: dozens of pages


class Gated(httpx.AsyncByteStream):
    """One SSE event, then the rest once `gate` is set: a stream still being decoded."""

    def __init__(self, first: bytes, gate: asyncio.Event):
        self.first, self.gate = first, gate

    async def __aiter__(self):
        yield self.first
        await self.gate.wait()
        yield EVENTS[-1]


class Cluster:
    """Prefill instances p0, p1, ... (bootstrap ports 9000 + i) and decode instances d0, d1, ...
    behind a PD router; each decode instance answers with the prefill header it was sent."""

    def __init__(self, prefill: int = 2, decode: int = 2):
        self.prefill_urls = [f"http://p{i}:{8000 + i}" for i in range(prefill)]
        self.decode_urls = [f"http://d{i}:{8100 + i}" for i in range(decode)]
        self.modes: dict[str, str | None] = {f"p{i}": "prefill" for i in range(prefill)}
        self.modes |= {f"d{i}": "decode" for i in range(decode)}  # None: /disaggregation is a 404
        self.down: set[str] = set()  # hosts that refuse connections
        self.posts: list[tuple[str, str | None]] = []  # (host, X-Shardserve-Prefill) per generation POST
        self.gate: asyncio.Event | None = None  # set: decode streams wait on it after their first event
        self.broken = False  # decode streams break after their first event
        client = httpx.AsyncClient(transport=httpx.MockTransport(self._handle), timeout=30)
        self.fwd: PDRouter = make_pd_router(
            self.prefill_urls, self.decode_urls, Router(prefill, "cache_aware", page_size=4, max_pages=1000),
            Router(decode, "least_load", page_size=4), KeyMaker(None), client, page_size=4, check_timeout=1)
        self.app = build_app(self.fwd, health_interval=60)

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if path == "/health":
            return httpx.Response(200)
        if path == "/disaggregation":
            mode = self.modes[host]
            if mode is None:
                return httpx.Response(404, json={"detail": "Not Found"})
            port = 9000 + int(host[1:]) if mode == "prefill" else None
            return httpx.Response(200, json={"mode": mode, "bootstrap_port": port})
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}], "host": host})
        header = request.headers.get(PREFILL_HEADER)
        self.posts.append((host, header))
        said = {"decode": host, "prefill": header}
        if not json.loads(request.content).get("stream"):
            return httpx.Response(200, json=said)
        first = f"data: {json.dumps(said)}\n\n".encode()
        if self.broken:
            return httpx.Response(200, headers=SSE, stream=Events([first], fail=httpx.ReadError("reset")))
        if self.gate is not None:
            return httpx.Response(200, headers=SSE, stream=Gated(first, self.gate))
        return httpx.Response(200, headers=SSE, stream=Events([first, EVENTS[-1]]))

    async def send(self, path: str, body=None, headers: dict | None = None) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(self.app), base_url="http://router") as c:
            if path.startswith("/v1/c"):
                return await c.post(path, content=json.dumps(body).encode(), headers=headers)
            return await c.get(path)

    def request(self, path: str, body=None, headers: dict | None = None) -> httpx.Response:
        return asyncio.run(self.send(path, body, headers))

    def check(self) -> None:
        """A round of health checks, as the app's lifespan runs them (ASGITransport runs none)."""
        async def both():
            await asyncio.gather(self.fwd.prefill.check_all(), self.fwd.pool.check_all())

        asyncio.run(both())

    def released(self) -> bool:
        """Nothing left on either pool's books."""
        routers = (self.fwd.prefill.router, self.fwd.router)
        return all(not r.requests and all(s.load == 0 and s.in_flight == 0 for s in r.replicas) for r in routers)


def answer(r: httpx.Response) -> dict:
    """What the decode instance said it was sent, streamed or not."""
    if r.headers["content-type"].startswith("text/event-stream"):
        return json.loads(r.text.split("\n\n")[0].removeprefix("data: "))
    return r.json()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "hello"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_decode_is_told_the_prefill_instances_bootstrap_address(path, body, stream):
    c = Cluster()
    c.check()
    r = c.request(path, body | {"stream": stream, "max_tokens": 5})
    assert r.status_code == 200
    assert answer(r) == {"decode": "d0", "prefill": "tcp://p0:9000"}
    assert c.posts == [("d0", "tcp://p0:9000")]  # the router POSTs to the decode instance alone
    assert c.released()


def test_a_repeated_long_prompt_keeps_its_prefill_instance_and_another_may_go_elsewhere():
    c = Cluster()
    c.check()
    for _ in range(3):
        assert answer(c.request("/v1/completions", {"prompt": LONG + "question one"}))["prefill"] == "tcp://p0:9000"
    assert len(c.fwd.prefill.router.replicas[0].prefixes.stored) > 10  # credited once it answered
    assert answer(c.request("/v1/completions", {"prompt": "something else entirely"}))["prefill"] == "tcp://p1:9001"
    assert answer(c.request("/v1/completions", {"prompt": LONG + "question two"}))["prefill"] == "tcp://p0:9000"
    assert not c.fwd.pool.router.replicas[0].prefixes.stored  # the pages are the prefill instance's
    assert c.released()


def test_concurrent_streams_land_on_the_least_loaded_decode_instances():
    c = Cluster()
    c.check()

    async def go() -> list[httpx.Response]:
        c.gate = asyncio.Event()
        body = {"prompt": LONG, "stream": True, "max_tokens": 100}
        sent = [asyncio.ensure_future(c.send("/v1/completions", body)) for _ in range(2)]
        while len(c.posts) < 2 or len(c.fwd.relays) < 2:
            await asyncio.sleep(0.01)
        assert sorted(host for host, _ in c.posts) == ["d0", "d1"]
        assert all(r.load > 100 for r in c.fwd.router.replicas)  # the whole prompt plus max_tokens
        assert c.fwd.prefill.router.replicas[0].in_flight == 2  # the same prompt: the same prefill instance
        c.gate.set()
        return await asyncio.wait_for(asyncio.gather(*sent), 5)

    assert all(r.text.endswith("data: [DONE]\n\n") for r in asyncio.run(go()))
    assert c.released()


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_instance_that_is_down_is_skipped_with_the_same_prefill_instance(stream):
    c = Cluster()
    c.check()
    c.down.add("d0")  # gone since the last check
    r = c.request("/v1/completions", {"prompt": "hello", "stream": stream})
    assert answer(r) == {"decode": "d1", "prefill": "tcp://p0:9000"}
    assert not c.fwd.pool.is_healthy(0) and c.released()
    assert c.request("/health").json()["decode"] == {"http://d0:8100": "unhealthy", "http://d1:8101": "healthy"}


def test_a_stream_broken_midway_releases_both_instances():
    c = Cluster()
    c.check()
    c.broken = True
    r = c.request("/v1/completions", {"prompt": "hello", "stream": True})
    assert "d0:8100 failed mid-stream" in r.text and r.text.endswith("data: [DONE]\n\n")
    assert c.released() and c.fwd.prefill.router.replicas[0].prefixes.stored  # the prompt did get computed


@pytest.mark.parametrize("mode, says", [("decode", "says mode 'decode'"), ("null", "says mode 'null'"),
                                        (None, "answered 404")])
def test_a_prefill_url_in_another_mode_is_unhealthy_and_never_named(caplog, mode, says):
    c = Cluster()
    c.modes["p0"] = mode

    async def go():
        async with c.app.router.lifespan_context(c.app):  # the startup checks
            health = await c.send("/health")
            answers = [await c.send("/v1/completions", {"prompt": p}) for p in ("a", LONG, "b" * 50)]
            return health, answers

    with caplog.at_level(logging.WARNING, logger="shardserve.router"):
        health, answers = asyncio.run(go())
    assert health.json() == {"status": "ok", "prefill": {"http://p0:8000": "unhealthy", "http://p1:8001": "healthy"},
                             "decode": {"http://d0:8100": "healthy", "http://d1:8101": "healthy"}}
    assert {answer(r)["prefill"] for r in answers} == {"tcp://p1:9001"}
    lines = [r.getMessage() for r in caplog.records if "p0:8000" in r.getMessage()]
    assert len(lines) == 1 and "expected mode 'prefill'" in lines[0] and says in lines[0], lines


def test_a_prefill_instance_never_checked_is_never_named():
    c = Cluster()  # no check yet: no bootstrap address known
    r = c.request("/v1/completions", {"prompt": "hello"})
    assert r.status_code == 503 and "no healthy prefill instance" in r.json()["error"]["message"]
    assert c.posts == [] and c.released()


def test_health_is_503_and_requests_refused_when_a_role_has_no_healthy_instance():
    c = Cluster()
    c.down |= {"d0", "d1"}
    c.check()
    health = c.request("/health")
    assert health.status_code == 503
    assert health.json()["error"]["message"] == "no healthy decode instance: http://d0:8100, http://d1:8101"
    r = c.request("/v1/completions", {"prompt": "hello"})
    assert r.status_code == 503 and r.json()["error"]["message"].startswith("no healthy decode instance")
    c.down = {"p0", "p1"}
    c.check()
    assert "no healthy prefill instance" in c.request("/health").json()["error"]["message"]
    r = c.request("/v1/completions", {"prompt": "hello"})
    assert r.status_code == 503 and r.json()["error"]["message"].startswith("no healthy prefill instance")
    assert c.released()


def test_a_client_cannot_name_the_prefill_instance():
    c = Cluster()
    c.check()
    r = c.request("/v1/completions", {"prompt": "x"}, headers={PREFILL_HEADER: "tcp://elsewhere:1"})
    assert answer(r)["prefill"] == "tcp://p0:9000" and c.posts == [("d0", "tcp://p0:9000")]


def test_models_and_metrics():
    c = Cluster()
    c.check()
    c.request("/v1/completions", {"prompt": "hello"})
    assert c.request("/v1/models").json()["host"] == "d0"  # the first healthy decode instance's
    metrics = c.request("/metrics").text
    assert 'shardserve_router_requests_total{role="prefill",worker="http://p0:8000"} 1.0' in metrics
    assert 'shardserve_router_requests_total{role="decode",worker="http://d0:8100"} 1.0' in metrics
    assert 'shardserve_router_worker_healthy{role="prefill",worker="http://p1:8001"} 1.0' in metrics
    assert metrics.count("# TYPE shardserve_router_requests_total counter") == 1


def test_bootstrap_address():
    assert bootstrap_address("http://10.0.0.1:30000", 8998) == "tcp://10.0.0.1:8998"
    assert bootstrap_address("https://Host.example", 1) == "tcp://host.example:1"
    assert bootstrap_address("http://[::1]:30000", 8998) == "tcp://[::1]:8998"


@pytest.mark.parametrize("argv, message", [
    (["router"], "give --worker-urls URL ... (plain mode), or --prefill URL ... --decode URL ..."),
    (["router", "--prefill", "http://a:1"], "--prefill needs --decode"),
    (["router", "--decode", "http://a:1"], "--decode needs --prefill"),
    (["router", "--worker-urls", "http://a:1", "--prefill", "http://b:1", "--decode", "http://c:1"],
     "--worker-urls (plain mode) cannot be combined with --prefill/--decode"),
    (["router", "--worker-urls", "http://a:1", "--decode", "http://c:1"], "--worker-urls (plain mode) cannot"),
    (["router", "--prefill", "a:1", "--decode", "http://c:1"], "argument --prefill: expected a URL"),
])
def test_router_mode_flags_are_one_line_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardserve router: error: ") and message in err, err


def test_router_flags_build_either_mode():
    parser = build_parser()
    pd = parser.parse_args(["router", "--prefill", "http://p:1/", "--decode", "http://d:1", "http://e:1"])
    assert (pd.prefill, pd.decode, pd.worker_urls, pd.policy) == (["http://p:1"], ["http://d:1", "http://e:1"],
                                                                   None, "cache_aware")
    fwd, said = build_forwarder(pd, None)
    assert isinstance(fwd, PDRouter) and "prefill/decode mode" in said and "http://e:1" in said
    assert (fwd.prefill.router.policy, fwd.router.policy) == ("cache_aware", "least_load")
    asyncio.run(fwd.client.aclose())
    pd = parser.parse_args(["router", "--prefill", "http://p:1", "--decode", "http://d:1", "--policy", "round_robin"])
    fwd, _ = build_forwarder(pd, None)
    assert (fwd.prefill.router.policy, fwd.router.policy) == ("round_robin", "least_load")
    asyncio.run(fwd.client.aclose())
    plain = parser.parse_args(["router", "--worker-urls", "http://a:1", "http://b:1"])
    fwd, said = build_forwarder(plain, None)
    assert type(fwd) is HTTPRouter and said == "by cache_aware over http://a:1, http://b:1"
    asyncio.run(fwd.client.aclose())
