"""The standalone router (`shardserve router`) for real: two `shardserve serve` workers and
`python -m shardserve router` as subprocesses; a worker killed mid-stream and restarted on its
port. The forwarding's corner cases (retries, timeouts, broken streams) are driven in process
against scripted workers in tests/unit/test_http_router.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from unittest import mock

import httpx
import openai
import pytest
import server_util
from prometheus_client.parser import text_string_to_metric_families
from server_util import Server, alive, descendants, free_port

PROMPT = "The capital of France is"
LONG = "Hello, how are you today? I am fine, thank you. What is the weather like? It is sunny and warm. "


def start_worker(path: str, log: str, port: int | None = None) -> Server:
    with mock.patch.object(server_util, "free_port", lambda: port) if port else contextlib.nullcontext():
        # One tokenizer process that also detokenizes: a process less to start on a small machine.
        return Server("--model", path, "--num-pages", "256", "--page-size", "8", "--num-tokenizers", "0",
                      log_path=log)


def kill_hard(server: Server) -> None:
    """SIGKILL a worker and every process under it, as a machine failure would."""
    pids = [server.proc.pid, *descendants(server.proc.pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    server.proc.wait(10)
    server.log.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)]


class RouterProc:
    def __init__(self, *args: str, log_path: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path, self.log = log_path, open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "shardserve", "router", "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def read_log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def metric(self, name: str) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return {s.labels["worker"]: s.value for fam in text_string_to_metric_families(text)
                for s in fam.samples if s.name == name}

    def wait_health(self, want: dict[str, str], timeout: float) -> None:
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.read_log()
            with contextlib.suppress(httpx.HTTPError):
                last = httpx.get(self.url + "/health", timeout=2).json()
                if last.get("workers") == want:
                    return
            time.sleep(0.1)
        raise AssertionError(f"router health {last}, wanted {want}\n{self.read_log()[-3000:]}")


class Cluster:
    def __init__(self, path: str, logs, workers: list[Server], router: RouterProc):
        self.path, self.logs, self.workers, self.router = path, logs, workers, router

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    def client(self, url: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=(url or self.router.url) + "/v1", api_key="none", max_retries=0, timeout=60)

    def requests_by_worker(self) -> dict[str, float]:
        return self.router.metric("shardserve_router_requests_total")


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    path, _ = tiny_model("llama")
    logs = tmp_path_factory.mktemp("router")
    workers: list = [None, None]
    errors: list[BaseException] = []

    def start(i: int) -> None:
        try:
            workers[i] = start_worker(path, str(logs / f"worker{i}.log"))
        except Exception as e:  # handed to the main thread
            errors.append(e)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    router = None
    try:
        assert not errors, errors
        router = RouterProc("--worker-urls", workers[0].url, workers[1].url, "--model", path, "--page-size", "8",
                            "--health-interval", "0.5", log_path=str(logs / "router.log"))
        router.wait_health({w.url: "healthy" for w in workers}, timeout=60)
        yield Cluster(path, logs, workers, router)
    finally:
        if router is not None:
            kids = descendants(router.proc.pid)
            if router.proc.poll() is None:
                router.proc.send_signal(signal.SIGTERM)
            try:
                code = router.proc.wait(15)
            except subprocess.TimeoutExpired:
                router.proc.kill()
                code = router.proc.wait()
            router.log.close()
        for w in workers:
            if w is not None and w.proc.poll() is None:
                w_code, left = w.stop()
                assert left == [] and w_code == 0, w.read_log()[-3000:]
        if router is not None:
            assert code == 0, router.read_log()[-3000:]
            assert not [p for p in kids if alive(p)]


def stream_text(stream) -> str:
    return "".join(c.choices[0].text for c in stream)


@pytest.mark.slow
def test_router_answers_as_a_worker_does(cluster):
    direct = cluster.client(cluster.urls[0]).completions.create(model=None, prompt=PROMPT, max_tokens=10,
                                                                  temperature=0)
    c = cluster.client()
    routed = c.completions.create(model=None, prompt=PROMPT, max_tokens=10, temperature=0)
    assert routed.choices[0].text == direct.choices[0].text and routed.usage == direct.usage
    streamed = c.completions.create(model=None, prompt=PROMPT, max_tokens=10, temperature=0, stream=True)
    assert stream_text(streamed) == direct.choices[0].text
    chat = c.chat.completions.create(model=None, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                     temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    models = httpx.get(cluster.router.url + "/v1/models", timeout=5)
    assert models.status_code == 200 and models.json()["data"]
    bad = httpx.post(cluster.router.url + "/v1/completions", content=b"{oops", timeout=5)
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
    # The worker's own validation passes through unchanged.
    worse = httpx.post(cluster.router.url + "/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=5)
    assert worse.status_code == 400 and worse.json()["error"]["param"] == "max_tokens"


@pytest.mark.slow
def test_cache_aware_keeps_a_prefix_on_its_worker(cluster):
    c, urls = cluster.client(), cluster.urls
    before = cluster.requests_by_worker()
    prompt_before = cluster.router.metric("shardserve_router_routed_prompt_tokens")
    # A long stream keeps one worker busy, so the first prompt with the shared prefix goes to the other...
    with c.completions.create(model=None, prompt="It is warm", max_tokens=400, temperature=0, stream=True,
                              extra_body={"ignore_eos": True}) as busy:
        next(iter(busy))
        in_flight = cluster.router.metric("shardserve_router_in_flight_requests")
        busy_url = next(u for u in urls if in_flight[u] == 1)
        other_url = next(u for u in urls if u != busy_url)
        answers = [c.completions.create(model=None, prompt=LONG + "one", max_tokens=2)]
    wait_idle(cluster.router)
    # ... and with both idle again the prefix keeps to it, whatever the tie-breaks would say.
    answers += [c.completions.create(model=None, prompt=LONG + tail, max_tokens=2) for tail in ("two", "three")]
    after = cluster.requests_by_worker()
    assert {u: after[u] - before[u] for u in urls} == {busy_url: 1, other_url: 3}
    # The router counts prompts with the model's tokenizer, as the worker does.
    prompt_after = cluster.router.metric("shardserve_router_routed_prompt_tokens")
    assert prompt_after[other_url] - prompt_before[other_url] == sum(a.usage.prompt_tokens for a in answers)


@pytest.mark.slow
def test_worker_killed_mid_stream_then_taken_back(cluster, tmp_path):
    c, router, urls = cluster.client(), cluster.router, cluster.urls
    stream = c.completions.create(model=None, prompt="Paris is", max_tokens=400, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    events = iter(stream)
    next(events)
    busy = router.metric("shardserve_router_in_flight_requests")
    victim = next(i for i, u in enumerate(urls) if busy[u] == 1)
    survivor = 1 - victim
    port = cluster.workers[victim].port
    kill_hard(cluster.workers[victim])
    # "failed": the broken connection was noticed as such, not waited out ("sent nothing", a 504).
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        for _ in events:
            pass
    before = cluster.requests_by_worker()
    for i in range(3):
        r = c.completions.create(model=None, prompt=f"The capital {i}", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
    after = cluster.requests_by_worker()
    assert (after[urls[victim]] - before[urls[victim]], after[urls[survivor]] - before[urls[survivor]]) == (0, 3)
    router.wait_health({urls[victim]: "unhealthy", urls[survivor]: "healthy"}, timeout=5)
    assert "down" in router.read_log()

    cluster.workers[victim] = start_worker(cluster.path, str(tmp_path / "restarted.log"), port)
    router.wait_health({u: "healthy" for u in urls}, timeout=5)  # a few 0.5 s health intervals
    # Two overlapping streams: the second goes to the other worker, so both take traffic again.
    before = cluster.requests_by_worker()
    streams = []
    for prompt in ("Hello, how", "What is the"):
        s = c.completions.create(model=None, prompt=prompt, max_tokens=400, temperature=0, stream=True,
                                 extra_body={"ignore_eos": True})
        streams.append(s)
        next(iter(s))
    after = cluster.requests_by_worker()
    assert all(after[u] - before[u] == 1 for u in urls)
    for s in streams:
        s.close()  # the router drops the worker connections, and the workers abort
    wait_idle(router)


def wait_idle(router: RouterProc, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while any(router.metric("shardserve_router_in_flight_requests").values()):
        assert time.monotonic() < deadline, "requests the clients closed were never released"
        time.sleep(0.1)


@pytest.mark.slow
def test_busy_port_is_one_line(cluster):
    r = subprocess.run([sys.executable, "-m", "shardserve", "router", "--port", str(cluster.router.port),
                        "--worker-urls", cluster.urls[0]], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot listen" in r.stderr and len(r.stderr.strip().splitlines()) == 1
