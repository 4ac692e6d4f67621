"""Disaggregated prefill/decode for real: prefill and decode instances (`shardserve serve
--disaggregation-mode ...`), the PD router in front, and a plain server as the reference; every
answer equal to the plain server's, KV bytes counted, and each fault (a decode instance dying
mid-transfer, a prefill instance dying, a client leaving) freeing every page at both ends while
both keep serving."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from unittest import mock

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_util import Server, alive, descendants
from test_router import RouterProc, kill_hard

pytestmark = pytest.mark.slow
SECRET = "pd-test-secret-0123456789abcdef"
HEADER = "X-Shardserve-Prefill"
TIMEOUT = 3  # --disaggregation-timeout of every instance
COMMON = ("--num-pages", "256", "--page-size", "8", "--num-tokenizers", "0")


def metric(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def pages_used(url: str) -> float:
    return metric(url, "shardserve_kv_pages_used")


def transfer(url: str, field: str) -> float:
    return metric(url, "shardserve_kv_transfer", field=field)


# Two machines as two loopback addresses: p1 listens on 127.0.0.2 only; d2 on every address, so the
# prefill instances send its KV to the address they see its leader at.
HOSTS = {"p1": "127.0.0.2", "d2": "0.0.0.0"}


def bootstrap(server: Server) -> str:
    host = server.url.removeprefix("http://").rsplit(":", 1)[0]
    return f"tcp://{host}:{httpx.get(server.url + '/disaggregation', timeout=5).json()['bootstrap_port']}"


class PD:
    def __init__(self, path, model, ref, prefills, decodes, router):
        self.path, self.model, self.ref, self.prefills, self.decodes, self.router = (
            path, model, ref, prefills, decodes, router)

    def post(self, url: str, body: dict, prefill: Server | None = None, path: str = "/v1/completions"):
        headers = {HEADER: bootstrap(prefill)} if prefill is not None else {}
        return httpx.post(url + path, json=body, headers=headers, timeout=60)


def start(args_by_name: dict[str, tuple], logs, hosts: dict[str, str]) -> dict[str, Server]:
    out, errors = {}, []

    def one(name: str, args: tuple) -> None:
        try:
            out[name] = Server(*args, log_path=str(logs / f"{name}.log"), host=hosts.get(name))
        except Exception as e:  # handed to the main thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=item) for item in args_by_name.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in out.values():
            s.stop()
        raise errors[0]
    return out


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    path, model = tiny_model("llama", 8)
    logs = tmp_path_factory.mktemp("pd")
    role = ("--disaggregation-timeout", str(TIMEOUT), "--disaggregation-mode")
    with mock.patch.dict(os.environ, {"SHARDSERVE_DIST_SECRET": SECRET}):
        servers = start({
            "ref": ("--model", path, *COMMON),
            "p1": ("--model", path, *COMMON, "--max-num-batched-tokens", "64", *role, "prefill"),
            "p2": ("--model", path, *COMMON, "--max-num-batched-tokens", "1", *role, "prefill"),
            "d1": ("--model", path, *COMMON, "--tp-size", "2", *role, "decode"),
            "d2": ("--model", path, *COMMON, *role, "decode"),
        }, logs, HOSTS)
    router = None
    try:
        p, d = [servers["p1"], servers["p2"]], [servers["d1"], servers["d2"]]
        router = RouterProc("--prefill", p[0].url, p[1].url, "--decode", d[0].url, d[1].url, "--model", path,
                            "--page-size", "8", "--health-interval", "0.5", log_path=str(logs / "router.log"))
        def healthy() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(router.url + "/health", timeout=2).status_code == 200
            return False

        wait_for(healthy, 60, "the router's /health to answer 200 (every instance healthy)")
        yield PD(path, model, servers["ref"], p, d, router)
    finally:
        if router is not None:
            kids = descendants(router.proc.pid)
            router.proc.terminate()
            router.proc.wait(15)
            router.log.close()
            assert not [k for k in kids if alive(k)]
        for name, s in servers.items():
            if s.proc.poll() is None:
                code, left = s.stop()
                assert left == [] and code == 0, (name, s.read_log()[-3000:])


def same(a: httpx.Response, b: httpx.Response) -> None:
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    ca, cb = a.json()["choices"], b.json()["choices"]
    assert [c.get("text", c.get("message")) for c in ca] == [c.get("text", c.get("message")) for c in cb]
    assert [c["finish_reason"] for c in ca] == [c["finish_reason"] for c in cb]
    assert a.json()["usage"] == b.json()["usage"]
    for x, y in zip(ca, cb):
        if x.get("logprobs"):
            assert x["logprobs"]["tokens"] == y["logprobs"]["tokens"]
            assert x["logprobs"]["token_logprobs"] == pytest.approx(y["logprobs"]["token_logprobs"], abs=1e-4)


def test_unseeded_sampling_continues_as_one_engine(pd):
    """Seeds a request does not give come from the decode instance's sequence, as from a plain
    server's; the prefill instance samples the first token with it and hands its generator's
    state over (prefill TP 1, decode TP 2: the KV heads are re-split on arrival)."""
    for body in ({"prompt": "a b c d e f g", "max_tokens": 12, "temperature": 1.0},
                 {"prompt": "x y z", "max_tokens": 8, "temperature": 0.9, "n": 2, "logprobs": 2}):
        same(pd.post(pd.ref.url, body), pd.post(pd.decodes[0].url, body, pd.prefills[0]))


@pytest.mark.parametrize("body", [
    {"prompt": "hello there how are you", "max_tokens": 10, "temperature": 0, "logprobs": 3},
    {"prompt": "one two three four five six", "max_tokens": 10, "temperature": 0.8, "seed": 11, "n": 2,
     "top_k": 20, "repetition_penalty": 1.2, "presence_penalty": 0.5},
    {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0, "stop": ["e"]},
    {"prompt": "score this prompt please", "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1},
])
def test_router_answers_as_one_server(pd, body):
    same(pd.post(pd.ref.url, body), pd.post(pd.router.url, body))


def test_streaming_chat_as_one_server(pd):
    body = {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 10, "temperature": 0.7,
            "seed": 5, "stream": True}

    def text(url: str) -> str:
        out = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    out += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
        return "".join(out)

    assert text(pd.ref.url) == text(pd.router.url)


def test_bytes_and_layer_by_layer(pd):
    """Bytes shipped = layers x 2 x prompt tokens x KV heads x head dim x 4, and a long prompt's
    layer 0 leaves before its last layer is computed."""
    cfg = pd.model.config
    p, d = pd.prefills[0], pd.decodes[1]
    sent0, chunks0, early0 = (transfer(p.url, f) for f in ("bytes", "chunks", "early_chunks"))
    prompt = [int(t) for t in torch_randint(300, 300, seed=3)]
    r = pd.post(d.url, {"prompt": prompt, "max_tokens": 2, "temperature": 0}, p)
    assert r.status_code == 200, r.text
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    deadline = time.monotonic() + 5
    while transfer(p.url, "bytes") - sent0 != per_token * len(prompt) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert transfer(p.url, "bytes") - sent0 == per_token * len(prompt)
    chunks = transfer(p.url, "chunks") - chunks0
    assert chunks == -(-len(prompt) // 64)  # p1's --max-num-batched-tokens
    assert transfer(p.url, "early_chunks") - early0 >= 1, "layer 0 never left before the last layer was computed"


def torch_randint(high: int, n: int, seed: int) -> list[int]:
    import torch

    return torch.randint(1, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(what)


def test_client_leaving_frees_both_ends(pd):
    """A client that goes away while its prompt is being prefilled: both instances free its pages."""
    p, d = pd.prefills[1], pd.decodes[1]  # p2 prefills one token a step: the client leaves mid-prefill
    before_p, before_d = pages_used(p.url), pages_used(d.url)
    body = json.dumps({"prompt": torch_randint(300, 400, seed=9), "max_tokens": 50}).encode()
    host, port = d.url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"{HEADER}: {bootstrap(p)}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(head + body)
        wait_for(lambda: metric(p.url, "shardserve_num_requests_running") >= 1, 10, "the prefill never started")
        assert pages_used(d.url) > before_d  # its pages are reserved on the decode side meanwhile
    wait_for(lambda: pages_used(p.url) == before_p and pages_used(d.url) == before_d, 10,
             f"pages not freed: prefill {pages_used(p.url)}, decode {pages_used(d.url)}")
    assert metric(p.url, "shardserve_num_requests_running") == 0
    same(pd.post(pd.ref.url, {"prompt": "still serving", "max_tokens": 4, "temperature": 0}),
         pd.post(d.url, {"prompt": "still serving", "max_tokens": 4, "temperature": 0}, p))


def busy_requests(url: str, prefill: Server, n: int, seed: int) -> tuple[list, list[threading.Thread]]:
    """n long prompts sent at once (each its own thread); their answers land in the list."""
    answers: list = []

    def one(i: int) -> None:
        try:
            r = httpx.post(url + "/v1/completions", headers={HEADER: bootstrap(prefill)}, timeout=60,
                           json={"prompt": torch_randint(300, 400, seed=seed + i), "max_tokens": 4})
            answers.append(r.status_code)
        except httpx.HTTPError as e:
            answers.append(type(e).__name__)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return answers, threads


def test_prefill_instance_dying_fails_requests_and_frees_decode_pages(pd):
    p2, d1 = pd.prefills[1], pd.decodes[0]
    before = pages_used(d1.url)
    answers, threads = busy_requests(d1.url, p2, 6, seed=100)
    wait_for(lambda: transfer(p2.url, "requests") >= 0 and pages_used(d1.url) > before, 10, "nothing reserved")
    kill_hard(p2)
    for t in threads:
        t.join(30)
    assert any(a == 503 for a in answers), answers  # the decode instance's error once the timeout passed
    wait_for(lambda: pages_used(d1.url) == before, 2 * TIMEOUT, f"decode pages stuck at {pages_used(d1.url)}")
    # The decode instance serves on, through the other prefill instance and through the router.
    body = {"prompt": "after the loss", "max_tokens": 6, "temperature": 0}
    same(pd.post(pd.ref.url, body), pd.post(d1.url, body, pd.prefills[0]))
    wait_for(lambda: httpx.get(pd.router.url + "/health", timeout=2).json()["prefill"][p2.url] == "unhealthy", 10,
             "the router still routes to the dead prefill instance")
    same(pd.post(pd.ref.url, body), pd.post(pd.router.url, body))


def test_decode_instance_dying_mid_transfer_frees_prefill_pages(pd):
    p1, d2 = pd.prefills[0], pd.decodes[1]
    answers, threads = busy_requests(d2.url, p1, 8, seed=200)
    wait_for(lambda: pages_used(p1.url) > 0, 10, "the prefill instance never started")
    kill_hard(d2)
    for t in threads:
        t.join(30)
    assert len(answers) == 8 and any(a != 200 for a in answers), answers
    wait_for(lambda: pages_used(p1.url) == 0, 2 * TIMEOUT + 2, f"prefill pages stuck at {pages_used(p1.url)}")
    body = {"prompt": "the prefill side lives on", "max_tokens": 6, "temperature": 0}
    same(pd.post(pd.ref.url, body), pd.post(pd.decodes[0].url, body, p1))
    wait_for(lambda: httpx.get(pd.router.url + "/health", timeout=2).json()["decode"][d2.url] == "unhealthy", 10,
             "the router still routes to the dead decode instance")
    same(pd.post(pd.ref.url, body), pd.post(pd.router.url, body))
