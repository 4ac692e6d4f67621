"""Who may talk to the server: the API key (given by environment, so never in `ps` or the log),
the bounds a client cannot exceed, and the standalone router's own key in front of a keyed worker."""

from __future__ import annotations

import secrets
import subprocess
import time

import httpx
import openai
import pytest
import torch
from server_util import Server
from test_router import RouterProc
from transformers import AutoTokenizer


def ps_text() -> str:
    return subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def wait_healthy(url: str, headers: dict | None = None, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", headers=headers, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} never became healthy")


@pytest.mark.slow
def test_api_key_bounds_and_router_key(tiny_model, tmp_path, monkeypatch):
    path, model = tiny_model("llama")
    key, router_key = f"sk-worker-{secrets.token_hex(8)}", f"sk-router-{secrets.token_hex(8)}"
    monkeypatch.setenv("SHARDSERVE_API_KEY", key)
    server = Server("--model", path, "--num-pages", "64", "--max-prompts", "3", "--max-stop-strings", "2",
                    "--max-stop-length", "8", "--max-body-bytes", "4000", log_path=str(tmp_path / "server.log"))
    router = None
    try:
        url = server.url
        # No key, a wrong key: 401 with an OpenAI error body; /health and /metrics stay open.
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(url + "/tokenize", json={"prompt": "hi"}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
        assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
        # The right key: transformers' greedy tokens.
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        text = client.completions.create(model=None, prompt=[5, 6, 7], max_tokens=8, temperature=0).choices[0].text
        with torch.no_grad():
            ref = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert text == AutoTokenizer.from_pretrained(path).decode(ref[0, 3:], skip_special_tokens=True)

        # Every bound: a 400 (or 413) naming the limit or the field.
        def refused(status: int, words: str, **body) -> None:
            r = httpx.post(url + "/v1/completions", json={"max_tokens": 2, **body},
                           headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == status and words in r.json()["error"]["message"], r.text

        refused(400, "--max-prompts", prompt=["a", "b", "c", "d"])
        refused(400, "--max-stop-strings", prompt="a", stop=["x", "y", "z"])
        refused(400, "--max-stop-length", prompt="a", stop=["123456789"])
        refused(400, "logprobs", prompt="a", logprobs=21)
        refused(400, "context", prompt="a", max_tokens=10**6)
        refused(413, "exceeds the limit of 4000", prompt="a" * 5000)
        refused(400, "n must be between", prompt="a", n=10**3)
        # A request's own chat template runs only on a server started with --trust-request-chat-template.
        r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
        r = httpx.post(url + "/tokenize", headers={"Authorization": f"Bearer {key}"},
                       json={"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text

        # The standalone router: its own key for clients; the workers' key passed on, never the client's.
        monkeypatch.setenv("SHARDSERVE_API_KEY", router_key)
        monkeypatch.setenv("SHARDSERVE_WORKER_API_KEY", key)
        router = RouterProc("--worker-urls", url, "--metrics-require-key", log_path=str(tmp_path / "router.log"))
        wait_healthy(router.url, {"Authorization": f"Bearer {router_key}"})
        assert httpx.get(router.url + "/metrics").status_code == 401  # --metrics-require-key
        assert httpx.post(router.url + "/v1/completions", json={"prompt": [5], "max_tokens": 1}).status_code == 401
        via = openai.OpenAI(base_url=router.url + "/v1", api_key=router_key, max_retries=0)
        assert via.completions.create(model=None, prompt=[5, 6, 7], max_tokens=8, temperature=0).choices[0].text == text
        with pytest.raises(openai.AuthenticationError):  # the worker's key is not the router's
            openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0).models.list()
        # Given by environment, no key shows in any process's arguments or in either log.
        shown = ps_text() + server.read_log() + router.read_log()
        assert key not in shown and router_key not in shown
    finally:
        if router is not None:
            router.proc.terminate()
            router.proc.wait(10)
        code, left = server.stop()
    assert left == []
