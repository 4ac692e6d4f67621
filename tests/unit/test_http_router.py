"""The standalone router's forwarding (gateway/http_router.py), in process: its app driven over
ASGI against scripted workers (httpx.MockTransport). Retries, timeouts, pass-through, streams that
break, what each worker is credited with, and the `router` command's flags. The real thing, with
real workers, is tests/e2e/test_router.py."""

from __future__ import annotations

import asyncio
import gzip
import inspect
import json

import httpx
import pytest

from shardserve.gateway import http_router
from shardserve.gateway.http_router import HTTPRouter
from shardserve.gateway.request_key import KeyMaker, RouteKey
from shardserve.gateway.standalone import build_app
from shardserve.gateway.workers import WorkerPool
from shardserve.kvcache.pages import page_hashes
from shardserve.router.policy import POLICIES, Router

SSE = {"content-type": "text/event-stream"}
EVENTS = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n', b"data: [DONE]\n\n"]
TIMEOUT_S = 30  # the scripted router's read timeout, as its 504s name it
BROKE = httpx.RemoteProtocolError("peer closed connection without sending complete message body")


class Events(httpx.AsyncByteStream):
    """SSE events, then (with `fail`) that exception, as a dropped or stalled connection raises."""

    def __init__(self, events: list[bytes], fail: Exception | None = None, hang: bool = False):
        self.events, self.fail, self.hang = events, fail, hang

    async def __aiter__(self):
        for e in self.events:
            yield e
        if self.hang:
            await asyncio.sleep(3600)
        if self.fail is not None:
            raise self.fail


class Scripted:
    """Workers w0, w1, ... answering by a function of (worker index, request); records calls."""

    def __init__(self, n: int, answer):
        self.urls = [f"http://w{i}" for i in range(n)]
        self.answer, self.calls, self.headers = answer, [], []
        client = httpx.AsyncClient(transport=httpx.MockTransport(self._handle), timeout=TIMEOUT_S)
        self.router = Router(n, "cache_aware", page_size=4, max_pages=1000)
        self.pool = WorkerPool(self.urls, self.router, client, check_timeout=1)
        self.fwd = HTTPRouter(self.pool, KeyMaker(None), client, 4)
        self.app = build_app(self.fwd, health_interval=60)

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        i = self.urls.index(f"http://{request.url.host}")
        self.calls.append((i, request.url.path))
        self.headers.append(request.headers)
        answer = self.answer(i, request)
        return await answer if inspect.isawaitable(answer) else answer

    async def send(self, path: str, body, headers: dict | None = None) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(self.app), base_url="http://router") as c:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            return await c.request("POST" if path.startswith("/v1/c") else "GET", path, content=content,
                                   headers=headers)

    def post(self, path: str, body, headers: dict | None = None) -> httpx.Response:
        return asyncio.run(self.send(path, body, headers))

    def held(self, i: int) -> tuple[list[bytes], list[bytes]]:
        """(stored, pending) pages the router credits worker `i` with."""
        prefixes = self.router.replicas[i].prefixes
        return list(prefixes.stored), list(prefixes.pending)


def ok_json(i: int, _req) -> httpx.Response:
    return httpx.Response(200, json={"worker": i})


def sse(i: int, _req) -> httpx.Response:
    return httpx.Response(200, headers=SSE, stream=Events(EVENTS))


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", 400, None),  # the parser recurses
    ("/v1/completions", b'{"prompt": "x", "stop": ' + b"[" * 200 + b"]" * 200 + b"}", 400, None),  # parses, too deep
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/nothing", {"prompt": "x"}, 404, None),
])
def test_bad_input_gets_openai_error_bodies(path, body, status, param):
    w = Scripted(2, ok_json)
    r = w.post(path, body)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["code"] == str(status)
    assert w.calls == []  # refused by the router itself


def test_worker_4xx_passes_through_unretried():
    w = Scripted(2, lambda i, _: httpx.Response(400, json={"error": {"message": "bad temperature"}}))
    r = w.post("/v1/completions", {"prompt": "hello", "temperature": -1})
    assert r.status_code == 400 and r.json() == {"error": {"message": "bad temperature"}}
    assert len(w.calls) == 1 and not w.router.requests
    assert w.held(0) == ([], [])  # no answer, no credit


@pytest.mark.parametrize("exc", [httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                                 httpx.ReadError])  # the last two: a connection reset before the head
def test_unreachable_worker_is_retried_elsewhere_and_taken_out(exc):
    def answer(i, req):  # w0 fails before its response head
        if i == 0:
            raise exc("scripted failure", request=req)
        return ok_json(i, req)

    w = Scripted(2, answer)
    r = w.post("/v1/completions", {"prompt": "hello there", "max_tokens": 2})
    assert r.status_code == 200 and r.json() == {"worker": 1}
    assert w.calls == [(0, "/v1/completions"), (1, "/v1/completions")]
    assert not w.router.replicas[0].healthy and not w.router.requests
    w.post("/v1/completions", {"prompt": "hello there", "max_tokens": 2})
    assert w.calls[-1][0] == 1 and len(w.calls) == 3  # no second try at the dead one
    health = w.post("/health", b"")
    assert health.json() == {"status": "ok", "workers": {"http://w0": "unhealthy", "http://w1": "healthy"}}
    metrics = w.post("/metrics", b"").text
    assert 'shardserve_router_errors_total{worker="http://w0"} 1.0' in metrics
    assert 'shardserve_router_requests_total{worker="http://w1"} 2.0' in metrics


def test_every_worker_down_is_503():
    w = Scripted(2, lambda i, req: (_ for _ in ()).throw(httpx.ConnectError("refused", request=req)))
    r = w.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and "no healthy worker" in r.json()["error"]["message"]
    assert len(w.calls) == 2 and not w.router.requests
    assert w.post("/health", b"").status_code == 503


def test_5xx_is_retried_but_workers_stay_in_and_keep_no_credit():
    w = Scripted(2, lambda i, _: httpx.Response([503, 500][i], json={"error": {"message": f"w{i} refused"}}))
    r = w.post("/v1/completions", {"prompt": "abcdefgh"})
    assert r.status_code == 500 and r.json()["error"]["message"] == "w1 refused"  # the last answer, as given
    assert sorted(i for i, _ in w.calls) == [0, 1]
    assert all(rep.healthy for rep in w.router.replicas) and not w.router.requests
    assert w.held(0) == w.held(1) == ([], [])


def test_pages_are_pending_while_a_request_runs_and_stored_by_the_worker_that_answered():
    release = asyncio.Event()

    async def answer(i, req):
        if i == 0:
            return httpx.Response(503, json={"error": {"message": "queue full"}})
        await release.wait()
        return ok_json(i, req)

    w = Scripted(2, answer)
    prompt = "abcdefgh"  # two full pages of 4; the last character is never a cache hit, so one counts
    page = page_hashes([ord(c) for c in prompt[:4]], 4)

    async def go() -> httpx.Response:
        sent = asyncio.ensure_future(w.send("/v1/completions", {"prompt": prompt}))
        while len(w.calls) < 2:
            await asyncio.sleep(0.01)
        assert w.held(0) == ([], []) and w.held(1) == ([], page)  # the refusal withdrew its claim
        release.set()
        return await sent

    assert asyncio.run(go()).json() == {"worker": 1}
    assert w.held(0) == ([], []) and w.held(1) == (page, [])
    w.post("/v1/completions", {"prompt": "abcdefghi"})  # nine characters: both full pages count
    assert w.held(1)[0] == page_hashes([ord(c) for c in "abcdefgh"], 4)[::-1]  # newest (the first page) last


def test_workers_are_asked_for_uncompressed_answers():
    w = Scripted(1, sse)
    r = w.post("/v1/completions", {"prompt": "x", "stream": True}, headers={"accept-encoding": "gzip, br"})
    assert r.content == b"".join(EVENTS)
    assert w.headers[0]["accept-encoding"] == "identity"  # not the client's, nor httpx's own gzip


def test_a_stream_compressed_anyway_reaches_the_client_readable():
    packed = gzip.compress(b"".join(EVENTS))
    w = Scripted(1, lambda i, _: httpx.Response(200, headers=SSE | {"content-encoding": "gzip"},
                                                stream=Events([packed[:10], packed[10:]])))
    r = w.post("/v1/completions", {"prompt": "x", "stream": True})
    assert "content-encoding" not in r.headers and r.content == b"".join(EVENTS)


def test_stream_relayed_unchanged_and_credited_at_its_first_event():
    w = Scripted(2, sse)
    r = w.post("/v1/completions", {"prompt": "abcde", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.content == b"".join(EVENTS)
    assert w.held(0) == (page_hashes([ord(c) for c in "abcd"], 4), [])


def test_stream_broken_before_its_first_event_is_retried():
    def answer(i, _):
        return httpx.Response(200, headers=SSE, stream=Events([b'data: {"hal'] if i == 0 else EVENTS,
                                                              fail=BROKE if i == 0 else None))

    w = Scripted(2, answer)
    r = w.post("/v1/completions", {"prompt": "abcde", "stream": True})
    assert r.content == b"".join(EVENTS)  # nothing of worker 0's half event reached the client
    assert [i for i, _ in w.calls] == [0, 1]
    assert w.held(0) == ([], []) and w.held(1)[0]


def test_stream_broken_midway_ends_with_an_error_event():
    w = Scripted(2, lambda i, _: httpx.Response(200, headers=SSE, stream=Events([EVENTS[0], b'data: {"cho'],
                                                                                  fail=BROKE)))
    r = w.post("/v1/completions", {"prompt": "x", "stream": True})
    assert r.content.startswith(EVENTS[0])
    events = [e for e in r.content.decode().split("\n\n") if e]
    assert len(events) == 3 and events[-1] == "data: [DONE]"
    err = json.loads(events[1].removeprefix("data: "))["error"]
    assert "http://w0 failed mid-stream" in err["message"] and err["code"] == "503"
    assert len(w.calls) == 1  # too late to retry: the client had an event already
    assert not w.router.requests and not w.router.replicas[0].healthy


def stalls(i: int, req: httpx.Request):
    """Worker 0 takes longer than the read timeout: before its answer, or its stream's first event."""
    if i != 0:
        return ok_json(i, req)
    if json.loads(req.content).get("stream"):
        return httpx.Response(200, headers=SSE, stream=Events([], fail=httpx.ReadTimeout("timed out")))
    raise httpx.ReadTimeout("timed out", request=req)


@pytest.mark.parametrize("stream", [False, True])
def test_a_slow_worker_is_a_504_not_a_dead_worker(stream):
    w = Scripted(2, stalls)
    held = page_hashes([ord(c) for c in "abcd"], 4)
    w.router.replicas[0].prefixes.store(held)  # what draws the request to w0
    r = w.post("/v1/completions", {"prompt": "abcdefgh", "stream": stream})
    assert r.status_code == 504
    err = r.json()["error"]
    assert "http://w0" in err["message"] and f"{TIMEOUT_S} s" in err["message"] and err["code"] == "504"
    assert w.calls == [(0, "/v1/completions")]  # not retried: the next worker may be as slow
    assert w.router.replicas[0].healthy and w.held(0) == (held, [])  # still in, its cache still believed
    assert not w.router.requests
    assert 'shardserve_router_errors_total{worker="http://w0"} 1.0' in w.post("/metrics", b"").text


def test_a_stream_that_stalls_midway_ends_with_a_504_event():
    w = Scripted(1, lambda i, _: httpx.Response(200, headers=SSE, stream=Events(
        EVENTS[:1], fail=httpx.ReadTimeout("timed out"))))
    r = w.post("/v1/completions", {"prompt": "x", "stream": True})
    err = json.loads(r.content[len(EVENTS[0]):].decode().split("\n\n")[0].removeprefix("data: "))["error"]
    assert err["code"] == "504" and "http://w0 sent nothing mid-stream" in err["message"]
    assert w.router.replicas[0].healthy


def test_cut_all_ends_streams_and_waits_cleanly():
    async def answer(i, req):
        if json.loads(req.content).get("stream"):
            return httpx.Response(200, headers=SSE, stream=Events(EVENTS[:1], hang=True))
        await asyncio.sleep(3600)

    w = Scripted(2, answer)

    async def go():
        stream = asyncio.ensure_future(w.send("/v1/completions", {"prompt": "x", "stream": True}))
        plain = asyncio.ensure_future(w.send("/v1/completions", {"prompt": "y"}))
        while len(w.calls) < 2 or not w.fwd.relays:
            await asyncio.sleep(0.01)
        assert w.fwd.cut_all("the router is shutting down") == 2
        return await asyncio.wait_for(asyncio.gather(stream, plain), 5)

    stream, plain = asyncio.run(go())
    assert stream.content == EVENTS[0] + http_router.sse_error("the router is shutting down")
    assert plain.status_code == 503 and plain.json()["error"]["message"] == "the router is shutting down"
    assert not w.router.requests and not w.fwd.relays and not w.fwd.tasks
    assert all(r.healthy for r in w.router.replicas)  # the router stopping is no fault of the workers


def test_route_keys():
    keys = KeyMaker(None)  # character mode

    def key(kind, body):
        return asyncio.run(keys.key(kind, body))

    assert key("completions", {"prompt": "abc"}).ids == [97, 98, 99]
    assert key("completions", {"prompt": [5, 6, 7], "max_tokens": 4, "n": 2}) == RouteKey([5, 6, 7], 8)
    assert key("completions", {"prompt": ["ab", "zz"]}).ids == [97, 98]  # a batch routes by its first prompt
    assert key("completions", {"prompt": [[1, 2], [3]]}).ids == [1, 2]
    assert key("completions", {"prompt": [2**64, "x"]}).ids == []  # not ids: the worker will refuse it
    chat = key("chat", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3})
    assert chat == RouteKey([ord(c) for c in "user\nhi\n"], 3)
    assert key("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": True}).max_tokens is None


@pytest.mark.parametrize("flag", ["--policy", "--load-balance-method"])
def test_router_policy_flag_and_its_serve_alias(flag):
    from shardserve.cli.main import build_parser

    parser, base = build_parser(), ["router", "--worker-urls", "http://a:1"]
    assert parser.parse_args(base).policy == "cache_aware"
    for name in POLICIES:  # the policy module's names, every one
        assert parser.parse_args([*base, flag, name]).policy == name
    with pytest.raises(SystemExit):
        parser.parse_args([*base, flag, "random"])
