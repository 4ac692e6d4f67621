"""Every bad request gets the right status and an OpenAI-style error body; the server lives on."""

from __future__ import annotations

import httpx
import pytest

CASES = [
    ("malformed json", "/v1/completions", b"{not json", 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("mistyped max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("max_tokens < 1", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("temperature < 0", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("top_p zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p above one", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("n too large", "/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty token list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("token out of vocab", "/v1/completions", {"prompt": [1, 99999]}, 400, None),
    ("unknown model", "/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ("chat without messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("chat bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("body not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("seed beyond 64 bits", "/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("logprobs too many", "/v1/completions", {"prompt": "hi", "logprobs": 100}, 400, "logprobs"),
    ("top_k zero", "/v1/completions", {"prompt": "hi", "top_k": 0}, 400, "top_k"),
    ("n zero", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("negative token id", "/v1/completions", {"prompt": [3, -1]}, 400, None),
    ("empty stop string", "/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("chat content not text", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, None),
    ("tokenize without input", "/tokenize", {}, 400, "prompt"),
]


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request(tiny_server, name, path, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(tiny_server.url + path, headers={"content-type": "application/json"}, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] is not None and err["param"].startswith(param), err


def test_context_overflow_names_both_numbers(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": [5] * 100, "max_tokens": 500}, timeout=30)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "100" in msg and "500" in msg and "512" in msg
    s = httpx.post(tiny_server.url + "/v1/completions",
                   json={"prompt": [5] * 100, "max_tokens": 500, "stream": True}, timeout=30)
    assert s.status_code == 400  # a refused stream is still a plain HTTP error


def test_oversized_body(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/completions", content=b"x" * (9 * 2**20),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["message"]


def test_still_healthy_after_abuse(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3,
                                                              "temperature": 0}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(tiny_server.url + "/health").status_code == 200
