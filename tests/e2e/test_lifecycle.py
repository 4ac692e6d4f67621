"""Start-up failures, disconnects, crashes and shutdown: errors are clear, nothing hangs, no
process is left behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_util import LongStream, Server, free_port, unfinished


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_queue_limit_answers_503(tiny_model, tmp_path):
    path, _ = tiny_model("llama")
    server = Server("--model", path, "--num-pages", "64", "--max-queued-requests", "2",
                    log_path=str(tmp_path / "log"))
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [5], "n": 3, "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "service_unavailable"
        ok = httpx.post(server.url + "/v1/completions", json={"prompt": [5], "n": 2, "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200
    finally:
        code, left = server.stop()
    assert code == 0 and left == []


@pytest.mark.parametrize("num_tokenizers", [0, 2])
def test_tokenizer_worker_layouts(tiny_model, tmp_path, num_tokenizers):
    path, _ = tiny_model("llama")
    server = Server("--model", path, "--num-pages", "64", "--num-tokenizers", str(num_tokenizers),
                    log_path=str(tmp_path / "log"))
    try:
        texts = set()
        for _ in range(3):  # round-robin over the tokenizer workers
            r = httpx.post(server.url + "/v1/completions",
                           json={"prompt": "Hello, how are you?", "max_tokens": 8, "temperature": 0}, timeout=30)
            texts.add(r.json()["choices"][0]["text"])
        assert len(texts) == 1
    finally:
        code, left = server.stop()
    assert code == 0 and left == []


# The tiny Llama at 24 layers in float16 (see deep_server): a generation of hundreds of tokens
# takes long enough to still be running when a test acts on it; at 2 layers in float32 it can end
# in under a second.
DEEP = ("--dtype", "float16", "--page-size", "8")


def test_killed_scheduler_fails_requests_and_exits_nonzero(tiny_model, tmp_path):
    path, _ = tiny_model("llama", 24)
    server = Server("--model", path, *DEEP, "--num-pages", "256", log_path=str(tmp_path / "log"))
    # Killed once tokens flow, not after a fixed sleep: the tiny model can decode all 505 tokens
    # (its context limit) in well under a second, and a finished request has nothing to fail.
    stream = LongStream(server.url, max_tokens=505, timeout=30)
    stream.wait_running(30)
    wait_running(server.url, 1)
    os.kill(server.child_pid("scheduler-0"), signal.SIGKILL)
    saw_503 = False
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.proc.poll() is None:
        try:
            saw_503 |= httpx.get(server.url + "/health", timeout=1).status_code == 503
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    stream.assert_failed(10)
    code, left = server.stop()
    assert saw_503
    assert code != 0 and left == []
    assert "scheduler-0 was killed by signal 9" in server.read_log()


def test_child_that_fails_to_start_is_reported(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = {"architectures": ["NoSuchForCausalLM"], "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2}
    (bad / "config.json").write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "shardserve", "serve", "--model", str(bad),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    # Reported from the child's own Failed message, not noticed by waiting out the start-up timeout.
    assert "scheduler-0 failed to start" in proc.stderr and "NoSuchForCausalLM" in proc.stderr
    assert "timed out" not in proc.stderr


def test_busy_port_fails_fast(tiny_model, tmp_path):
    path, _ = tiny_model("llama")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "shardserve", "serve", "--model", path, "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and f"cannot listen on 127.0.0.1:{port}" in proc.stderr


def test_sigint_stops_everything(tiny_model, tmp_path):
    path, _ = tiny_model("llama")
    server = Server("--model", path, "--num-pages", "64", log_path=str(tmp_path / "log"))
    code, left = server.stop(signal.SIGINT)
    assert code == 0 and left == []


def engine(url: str) -> dict[str, float]:
    return {k: metric(url, f"shardserve_{k}") for k in
            ("engine_steps", "num_requests_running", "kv_pages_used", "engine_requests_finished")}


def wait_idle(url: str, timeout: float = 10) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = engine(url)
        if now["num_requests_running"] == 0 and now["kv_pages_used"] == 0:
            return now
        time.sleep(0.05)
    raise AssertionError(f"the engine did not go idle: {engine(url)}")


@pytest.fixture(scope="module")
def deep_server(tiny_model, tmp_path_factory):
    """The tiny Llama at 24 layers in float16 (layer by layer from Python; float32 or bfloat16
    would run the C decode loop): its decode steps take long enough (milliseconds) that a disconnect is noticed
    well within half of a 480-token generation even on a loaded 2-core machine (at 2 layers, or
    in the C loop, a step is so short the whole generation could finish first)."""
    path, _ = tiny_model("llama", 24)
    server = Server("--model", path, "--dtype", "float16", "--num-pages", "256", "--page-size", "8",
                    log_path=str(tmp_path_factory.mktemp("logs") / "deep.log"))
    yield server
    code, left = server.stop()
    assert code == 0 and left == [], server.read_log()[-3000:]


def wait_running(url: str, n: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while engine(url)["num_requests_running"] < n:
        assert time.monotonic() < deadline, f"fewer than {n} requests ever ran: {engine(url)}"
        time.sleep(0.005)


def test_disconnect_mid_stream_aborts_the_request(deep_server):
    url = deep_server.url
    before = wait_idle(url)
    body = {"prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        events = [next(lines) for _ in range(6)]
        # The state the test is about: tokens have streamed and the request is still generating.
        assert unfinished(events), events
        wait_running(url, 1)
    after = wait_idle(url)  # every page back
    # Aborted, not finished: the whole generation would have taken a step per token.
    assert after["engine_steps"] - before["engine_steps"] < body["max_tokens"] / 2, (before, after)
    assert after["engine_requests_finished"] - before["engine_requests_finished"] == 1


# The agent APIs: the tiny model has no EOS, so without ignore_eos (which they do not take) it runs on.
AGENT_APIS = [("/v1/messages", {"max_tokens": 480, "messages": [{"role": "user", "content": "hi"}]},
               "content_block_delta", "message_stop"),
              ("/v1/responses", {"max_output_tokens": 480, "input": "hi"}, "response.output_text.delta",
               "response.completed")]


@pytest.mark.parametrize("endpoint, body, delta, final", AGENT_APIS, ids=["messages", "responses"])
def test_disconnect_mid_stream_of_the_agent_apis(deep_server, endpoint, body, delta, final):
    url = deep_server.url
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    before = wait_idle(url)
    with httpx.stream("POST", url + endpoint, json={**body, "model": model, "stream": True}, timeout=30) as r:
        lines, events = r.iter_lines(), []  # next(), not a loop's break, which would close the stream
        while events.count(delta) < 3:
            events.append(next(lines).removeprefix("event: "))
        # The state the test is about: text has streamed and the response is still being generated.
        assert final not in events and "error" not in events, events
        wait_running(url, 1)
    after = wait_idle(url)
    assert after["engine_steps"] - before["engine_steps"] < 480 / 2, (before, after)
    assert after["engine_requests_finished"] - before["engine_requests_finished"] == 1


@pytest.mark.parametrize("endpoint, body", [
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 480,
                              "ignore_eos": True}),
    *[(endpoint, body) for endpoint, body, _, _ in AGENT_APIS],
])
def test_disconnect_of_a_non_streaming_request_aborts_it(deep_server, endpoint, body):
    tiny_server = deep_server
    url = tiny_server.url
    before = wait_idle(url)
    aborted = tiny_server.read_log().count("its request was aborted")
    if endpoint == "/v1/messages":
        body = {**body, "model": httpx.get(url + "/v1/models").json()["data"][0]["id"]}
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", tiny_server.port)) as conn:
        conn.sendall(f"POST {endpoint} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        wait_running(url, body.get("n", 1))  # generating: now leave
    after = wait_idle(url)
    # Aborted, not finished: far fewer steps than the generation needed, and every page back.
    assert after["engine_steps"] - before["engine_steps"] < 480 / 2, (before, after)
    assert after["engine_requests_finished"] - before["engine_requests_finished"] == body.get("n", 1)
    # This request's own abort, not an earlier test's on the same server.
    wait_for_log(tiny_server, "its request was aborted", aborted + 1)


def test_request_timeout_ends_a_long_request_and_frees_its_pages(tiny_model, tmp_path):
    """--request-timeout: a request running longer ends with a 504 naming the flag (a stream, with its error
    event), is aborted in the engine (far fewer steps than its length, every page back), and a short one is
    untouched."""
    path, _ = tiny_model("llama", 24)
    server = Server("--model", path, *DEEP, "--num-pages", "256", "--request-timeout", "1",
                    log_path=str(tmp_path / "log"))
    try:
        url = server.url
        before = wait_idle(url)
        long = {"prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=long, timeout=30)
        assert r.status_code == 504 and "--request-timeout 1 s" in r.json()["error"]["message"], r.text
        after = wait_idle(url)
        assert after["engine_steps"] - before["engine_steps"] < 480, (before, after)  # stopped, not finished
        with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True}, timeout=30) as s:
            events = [line for line in s.iter_lines() if line]
        assert events[-1] == "data: [DONE]" and "--request-timeout" in events[-2], events[-3:]
        wait_idle(url)
        short = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=30)
        assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 2
    finally:
        code, left = server.stop()
    assert code == 0 and left == []


def wait_for_log(server: Server, text: str, count: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while server.read_log().count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} logged {server.read_log().count(text)} times, not {count}"
        time.sleep(0.05)


def test_model_defaults_then_sigint_with_requests_in_flight(tiny_model, tmp_path):
    """One server for two checks (each start costs seconds): a model shipping generation defaults
    has them applied to requests that leave fields out; then Ctrl-C with requests running."""
    src, _ = tiny_model("llama", 24)  # slow enough for the long requests to be running at the Ctrl-C
    path = tmp_path / "model"
    shutil.copytree(src, path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 0}))
    server = Server("--model", str(path), *DEEP, "--num-pages", "512", log_path=str(tmp_path / "log"))
    assert "sampling defaults: temperature=0 top_p=1 top_k=-1 min_p=0 repetition_penalty=1 (from " \
           "generation_config.json)" in server.read_log()
    texts = {httpx.post(server.url + "/v1/completions", timeout=30, json={
        "prompt": "Hello there", "max_tokens": 12, "seed": seed, **extra}).json()["choices"][0]["text"]
        for seed, extra in ((1, {}), (2, {}), (3, {"temperature": 0}))}
    assert len(texts) == 1  # greedy by the model's default, whatever the seed
    results: dict[str, object] = {}
    long = {"prompt": [5, 6], "max_tokens": 505, "ignore_eos": True}

    def streamed() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json={**long, "stream": True}, timeout=30) as r:
            results["stream"] = [line for line in r.iter_lines() if line]

    def whole() -> None:
        results["whole"] = httpx.post(server.url + "/v1/completions", json={**long, "n": 2}, timeout=30)

    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]

    def agent(name: str, endpoint: str, body: dict) -> None:  # the agent APIs' streams end in their own error
        with httpx.stream("POST", server.url + endpoint, json={**body, "stream": True}, timeout=30) as r:
            results[name] = [line for line in r.iter_lines() if line]

    threads = [threading.Thread(target=streamed), threading.Thread(target=whole),
               threading.Thread(target=agent, args=("responses", "/v1/responses", {
                   "input": "hi", "max_output_tokens": 480})),
               threading.Thread(target=agent, args=("messages", "/v1/messages", {
                   "model": model, "max_tokens": 480, "messages": [{"role": "user", "content": "hi"}]}))]
    for t in threads:
        t.start()
    wait_running(server.url, 5)  # all five generating: the state the Ctrl-C must cut off
    code, left = server.stop(signal.SIGINT)
    for t in threads:
        t.join(10)
    log = server.read_log()
    assert code == 0 and left == [], (code, left)
    assert "shutting down: 4 requests in flight cut off" in log
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert results["whole"].status_code == 503
    assert results["whole"].json()["error"]["message"] == "the server is shutting down"
    events = results["stream"]
    assert events[-1] == "data: [DONE]" and "the server is shutting down" in events[-2], events[-3:]
    failed = json.loads(results["responses"][-1].removeprefix("data: "))
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"] == "the server is shutting down"
    error = json.loads(results["messages"][-1].removeprefix("data: "))
    assert error == {"type": "error", "error": {"type": "overloaded_error", "message": "the server is shutting down"}}
