"""A request whose own rows go non-finite fails alone with a 500 naming the cause, streamed or not; requests
beside it finish unchanged and the server stays healthy. The fault is real, not injected: the scripted model
(scripted_model.py) with one token's embedding set to infinity, so any prompt ending in it overflows."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from scripted_model import save_scripted_model
from server_util import Server
from transformers import AutoModelForCausalLM, AutoTokenizer

ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("poisoned"))
    script = save_scripted_model(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    newline = tok.encode("\n", add_special_tokens=False)
    poison = next(t for t in range(2, len(tok)) if t not in script + newline)  # off the script
    with torch.no_grad():
        model.model.embed_tokens.weight[poison] = float("inf")
    model.save_pretrained(path)
    server = Server("--model", path, "--num-pages", "128", "--page-size", "16", "--served-model-name", "m",
                    log_path=str(tmp_path_factory.mktemp("logs") / "server.log"))
    yield server, [5, 6, poison]
    code, left = server.stop()
    assert left == [] and code == 0, server.read_log()[-3000:]


def test_the_faulty_request_fails_alone(served):
    server, poisoned = served
    url = server.url
    chat = {}

    def beside() -> None:
        chat["r"] = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": ASK, "max_tokens": 32, "temperature": 0})

    t = threading.Thread(target=beside)
    t.start()
    r = httpx.post(url + "/v1/completions", json={"prompt": poisoned, "max_tokens": 8}, timeout=60)
    t.join(60)
    assert r.status_code == 500 and "not finite" in r.json()["error"]["message"], r.text
    assert chat["r"].status_code == 200 and chat["r"].json()["choices"][0]["message"]["content"] == (
        "<think>Rome?</think>Paris.")
    streamed = httpx.post(url + "/v1/completions", json={"prompt": poisoned, "max_tokens": 8, "stream": True},
                          timeout=60)
    assert streamed.status_code == 500 and "not finite" in streamed.json()["error"]["message"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    again = httpx.post(url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 32, "temperature": 0},
                       timeout=60)
    assert again.json()["choices"][0]["message"]["content"] == "<think>Rome?</think>Paris."
