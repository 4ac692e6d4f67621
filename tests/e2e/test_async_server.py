"""A server with --async-scheduling, as a user runs it: concurrent streams whose greedy tokens
equal transformers', a client that goes away mid-stream (its request aborted while the next step
is already planned), and a clean stop with nothing left running."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch
from server_util import Server

pytestmark = pytest.mark.slow
MODEL = None  # any name: one model is served


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    path, model = tiny_model("llama")
    log = str(tmp_path_factory.mktemp("async") / "server.log")
    s = Server("--model", path, "--num-pages", "256", "--page-size", "8", "--async-scheduling", log_path=log)
    s.model = model
    yield s
    code, left = s.stop()
    assert left == [], f"processes left behind: {left}"
    assert code == 0, s.read_log()[-3000:]


def generated(c: httpx.Client) -> float:
    """Tokens generated so far, from /metrics."""
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("shardserve_generation_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("no shardserve_generation_tokens_total in /metrics")


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


async def stream_ids(client: httpx.AsyncClient, prompt: list[int], n: int) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True, "logprobs": 0,
            "ignore_eos": True, "return_tokens_as_token_ids": True}
    ids: list[int] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                lp = json.loads(line[6:])["choices"][0].get("logprobs") or {}
                ids += [int(t.removeprefix("token_id:")) for t in lp.get("tokens", [])]
    return ids


def test_concurrent_streams_equal_transformers(server) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (int(k),), generator=g).tolist() for k in torch.randint(3, 40, (6,), generator=g)]
    lens = [5, 9, 14, 20, 3, 11]

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return await asyncio.gather(*(stream_ids(c, p, n) for p, n in zip(prompts, lens)))

    got = asyncio.run(go())
    assert got == [hf_greedy(server.model, p, n) for p, n in zip(prompts, lens)]


def test_a_client_gone_mid_stream_is_aborted(server) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        before = generated(c)
        with c.stream("POST", "/v1/completions", json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 5:
                    break  # the connection closes here, mid-stream
        for _ in range(100):
            m = c.get("/metrics").text
            if "shardserve_num_requests_running 0.0" in m:
                break
            time.sleep(0.1)
        assert "shardserve_num_requests_running 0.0" in m
        assert generated(c) - before < 400  # it ended early: aborted, not run to its max_tokens
        # the engine goes on serving
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
