"""Multi-LoRA behind the OpenAI server: the request's `model` names the adapter, /v1/models lists
them with their parent, adapters load and unload while serving (behind the API key), an adapter
unloaded mid-stream lets its request finish exactly as PEFT would, concurrent requests of three
adapters and the base model in two slots each get PEFT's tokens and logprobs, and bad adapters are
a 400 that leaves the server serving."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from lora_util import adapter_set
from server_util import Server

pytestmark = pytest.mark.slow
KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], list(range(40, 75))]
NEW, LONG = 12, 120


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    path, reqs, ref = adapter_set(tiny_model, tmp_path_factory.mktemp("adapters"), PROMPTS, NEW)
    return path, reqs, ref


@pytest.fixture(scope="module")
def server(adapters, tmp_path_factory):
    path, reqs, _ = adapters
    srv = Server("--model", path, "--num-pages", "256", "--num-tokenizers", "0", "--enable-lora", "--max-loras", "2",
                 "--max-lora-rank", "8", "--lora-modules", f"full={reqs['full'].lora_path}", "--api-key", KEY,
                 "--served-model-name", "tiny", log_path=str(tmp_path_factory.mktemp("log") / "server.log"))
    yield srv
    code, left = srv.stop()
    assert left == [] and code == 0, srv.read_log()[-3000:]


def complete(url: str, model: str, prompt: list[int], max_tokens: int = NEW) -> tuple[list[int], list[float], dict]:
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    lp = body["choices"][0]["logprobs"]
    return [int(t.split(":")[1]) for t in lp["tokens"]], lp["token_logprobs"], body


def same_as_peft(got: tuple, ref: tuple) -> None:
    assert got[0] == ref[0]
    assert got[1] == pytest.approx(ref[1], abs=1e-4)


def post(url: str, path: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=30)


def test_models_and_each_adapter_by_name(server, adapters):
    _, _, ref = adapters
    cards = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=5).json()["data"]
    assert [(c["id"], c.get("parent")) for c in cards] == [("tiny", None), ("full", "tiny")]
    for model, name in (("tiny", "base"), ("full", "full")):
        for p, prompt in enumerate(PROMPTS):
            toks, lps, body = complete(server.url, model, prompt)
            same_as_peft((toks, lps), ref[name][p])
            assert body["model"] == model
    r = post(server.url, "/v1/completions", {"model": "nope", "prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 404 and "'nope' does not exist" in r.json()["error"]["message"]


def test_load_at_run_time_mix_and_refusals(server, adapters):
    _, reqs, ref = adapters
    body = {"lora_name": "part", "lora_path": reqs["part"].lora_path}
    assert post(server.url, "/v1/load_lora_adapter", body, headers={}).status_code == 401
    r = post(server.url, "/v1/load_lora_adapter", body)
    assert r.status_code == 200, r.text
    again = post(server.url, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    stacked = post(server.url, "/v1/load_lora_adapter", {**body, "lora_name": "moe", "is_3d_lora_weight": True})
    assert stacked.status_code == 400 and "is_3d_lora_weight" in stacked.json()["error"]["message"]
    for bad, why in ((reqs["part"].lora_path + "-missing", "is not a directory"),
                     (server.log_path, "is not a directory")):
        r = post(server.url, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": bad})
        assert r.status_code == 400 and why in r.json()["error"]["message"]
        assert "\n" not in r.json()["error"]["message"]
    r = post(server.url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp", "extra": 1})
    assert r.status_code == 400 and "extra" in r.json()["error"]["message"]
    assert post(server.url, "/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": reqs["mlp"].lora_path}
                ).status_code == 200
    wrong = post(server.url, "/v1/unload_lora_adapter", {"lora_name": "mlp", "lora_int_id": 999})
    assert wrong.status_code == 404 and "lora_int_id 999" in wrong.json()["error"]["message"]
    # Three adapters and the base at once, two slots: each request gets its own adapter's tokens.
    jobs = [(m, n, p) for m, n in (("tiny", "base"), ("full", "full"), ("part", "part"), ("mlp", "mlp"))
            for p in range(len(PROMPTS))] * 2
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: complete(server.url, j[0], PROMPTS[j[2]]), jobs))
    for (_, name, p), g in zip(jobs, got):
        same_as_peft(g[:2], ref[name][p])
    # Three adapters through two slots: at least three loads, both slots used, nothing left running.
    deadline = time.monotonic() + 10
    while True:  # the engine's last Stats may still be on its way
        text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=5).text
        values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                  if line.startswith("shardserve_lora")}
        busy = [k for k in values if k.startswith("shardserve_lora_requests{")]
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert busy == []
    assert values['shardserve_lora_slots{state="total"}'] == 2 and values['shardserve_lora_slots{state="used"}'] == 2
    assert values["shardserve_lora_slot_loads"] >= 3


def test_unload_mid_stream_finishes_the_request(server, adapters, tiny_model, tmp_path):
    from lora_util import ADAPTERS, peft_greedy, save_adapter

    _, reqs, _ = adapters
    assert post(server.url, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": reqs["mlp"].lora_path}
                ).status_code == 200
    model = save_adapter(tiny_model("llama")[1], str(tmp_path / "again"), *ADAPTERS["mlp"])
    want = peft_greedy(model, PROMPTS[0], LONG)
    toks, lps = [], []
    with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, timeout=60, json={
            "model": "late", "prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True, "stream": True}) as r:
        unloaded, at_unload = False, 0
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            lp = json.loads(line[6:])["choices"][0]["logprobs"]
            toks += [int(t.split(":")[1]) for t in lp["tokens"]]
            lps += lp["token_logprobs"]
            if not unloaded:  # the request is running: take its adapter away
                assert post(server.url, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
                unloaded, at_unload = True, len(toks)
    assert unloaded and at_unload < LONG and len(toks) == LONG
    same_as_peft((toks, lps), want)
    r = post(server.url, "/v1/completions", {"model": "late", "prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 404
    assert post(server.url, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 404
    names = [c["id"] for c in httpx.get(server.url + "/v1/models", headers=AUTH, timeout=5).json()["data"]]
    assert "late" not in names


def test_bad_lora_modules_refused_at_start(adapters, tmp_path):
    import subprocess
    import sys

    path, reqs, _ = adapters
    for flags, why in ((["--enable-lora", "--max-lora-rank", "4", "--lora-modules", f"p={reqs['part'].lora_path}"],
                        "rank 8 exceeds --max-lora-rank 4"),
                       (["--lora-modules", f"p={reqs['part'].lora_path}"], "--lora-modules needs --enable-lora"),
                       (["--enable-lora", "--lora-modules", "nopath"], "expected name=path"),
                       # a repeated flag adds to the list (its second item is the bad one)
                       (["--enable-lora", "--lora-modules", f"p={reqs['part'].lora_path}", "--lora-modules", "q=/nope"],
                        "'q': /nope is not a directory")):
        r = subprocess.run([sys.executable, "-m", "shardserve", "serve", "--model", path, *flags],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and why in r.stderr, r.stderr
        assert r.stderr.splitlines()[-1].startswith("shardserve: error: ") and "Traceback" not in r.stderr


def test_load_inplace_replaces_an_adapter(server, adapters):
    """vLLM's load_inplace: the name now runs the new adapter's weights; a bad replacement is
    refused and leaves the old one serving."""
    _, reqs, ref = adapters
    body = {"lora_name": "swap", "lora_path": reqs["full"].lora_path}
    assert post(server.url, "/v1/load_lora_adapter", body).status_code == 200
    same_as_peft(complete(server.url, "swap", PROMPTS[0])[:2], ref["full"][0])
    bad = post(server.url, "/v1/load_lora_adapter", {**body, "lora_path": "/nope", "load_inplace": True})
    assert bad.status_code == 400 and "/nope is not a directory" in bad.json()["error"]["message"]
    same_as_peft(complete(server.url, "swap", PROMPTS[0])[:2], ref["full"][0])
    assert post(server.url, "/v1/load_lora_adapter", {**body, "lora_path": reqs["part"].lora_path,
                                                       "load_inplace": True}).status_code == 200
    same_as_peft(complete(server.url, "swap", PROMPTS[0])[:2], ref["part"][0])
    assert post(server.url, "/v1/unload_lora_adapter", {"lora_name": "swap"}).status_code == 200


def test_openai_sdk_names_an_adapter(server, adapters):
    """The openai client, unmodified: models.list shows the adapter, a completion and a chat
    completion run with it (and answer in its name), an unknown one raises NotFoundError."""
    import openai

    _, _, ref = adapters
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    assert "full" in [m.id for m in client.models.list()]
    out = client.completions.create(model="full", prompt=PROMPTS[0], max_tokens=NEW, temperature=0, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True})
    assert out.model == "full"
    assert [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens] == ref["full"][0][0]
    chat = client.chat.completions.create(model="full", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.model == "full" and chat.choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt=[1, 2], max_tokens=2)
