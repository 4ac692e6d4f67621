"""Speculative decoding behind the OpenAI server: answers equal a plain server's (streamed too, with
several tokens to a chunk), stop strings cut where the plain server's do, /metrics counts what was
proposed and accepted; and disaggregated, a decode instance speculates while its prefill instance
says it will not."""

from __future__ import annotations

import contextlib
import json
import os
from unittest import mock

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_disaggregation import SECRET, bootstrap, start, wait_for
from test_router import RouterProc

pytestmark = pytest.mark.slow
COMMON = ("--num-pages", "256", "--page-size", "8", "--num-tokenizers", "0")
SPEC = ("--speculative-method", "ngram", "--num-speculative-tokens", "3", "--ngram-min", "1",
        "--speculative-disable-by-batch-size", "64")
PROMPTS = [[5, 17, 200, 3, 99, 42], [250, 251, 7, 7, 7, 30, 1, 2, 3, 4, 5], [120] * 3]


def metrics(url: str) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def model_name(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]


def completion(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": model_name(url), "temperature": 0, "max_tokens": 40,
                                                  "logprobs": 1, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory):
    path = tiny_model("llama")[0]
    logs = tmp_path_factory.mktemp("spec")
    servers = start({"plain": ("--model", path, *COMMON), "spec": ("--model", path, *COMMON, *SPEC)}, logs, {})
    yield servers["plain"], servers["spec"]
    for s in servers.values():
        code, left = s.stop()
        assert code == 0 and left == []


def test_answers_equal_plain(pair) -> None:
    plain, spec = pair
    for prompt in PROMPTS:
        a, b = completion(plain.url, prompt=prompt), completion(spec.url, prompt=prompt)
        assert b["choices"][0]["text"] == a["choices"][0]["text"]
        assert b["choices"][0]["logprobs"] == a["choices"][0]["logprobs"]
        assert b["usage"] == a["usage"]
    m = metrics(spec.url)
    key = (("method", "ngram"),)
    proposed, accepted = m[("shardserve_spec_decode_num_draft_tokens", key)], m[(
        "shardserve_spec_decode_num_accepted_tokens", key)]
    assert 0 < accepted < proposed
    assert m[("shardserve_spec_decode_acceptance_rate", key)] == pytest.approx(accepted / proposed)
    assert m[("shardserve_spec_decode_num_emitted_tokens", key)] == accepted + m[(
        "shardserve_spec_decode_num_drafts", key)]
    assert ("shardserve_spec_decode_num_drafts", key) not in metrics(plain.url)


def test_stream_carries_accepted_runs(pair) -> None:
    plain, spec = pair
    want = completion(plain.url, prompt=PROMPTS[1])["choices"][0]
    chunks = []
    with httpx.stream("POST", spec.url + "/v1/completions", timeout=60, json={
            "model": model_name(spec.url), "prompt": PROMPTS[1], "temperature": 0, "max_tokens": 40, "logprobs": 1,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    assert "".join(c["text"] for c in chunks) == want["text"]
    per_chunk = [len(c["logprobs"]["tokens"]) for c in chunks if c.get("logprobs")]
    assert sum(per_chunk) == len(want["logprobs"]["tokens"]) and max(per_chunk) > 1


def test_stop_string_cuts_where_plain_does(pair) -> None:
    plain, spec = pair
    text = completion(plain.url, prompt=PROMPTS[1], max_tokens=60)["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    a = completion(plain.url, prompt=PROMPTS[1], max_tokens=60, stop=[stop])["choices"][0]
    b = completion(spec.url, prompt=PROMPTS[1], max_tokens=60, stop=[stop])["choices"][0]
    assert (b["text"], b["finish_reason"]) == (a["text"], a["finish_reason"]) and a["finish_reason"] == "stop"


def test_seeded_sampling_reproducible(pair) -> None:
    _, spec = pair
    body = dict(prompt=PROMPTS[0], temperature=0.9, seed=7, n=2, logprobs=None)
    assert completion(spec.url, **body)["choices"] == completion(spec.url, **body)["choices"]


def test_disaggregated_decode_speculates(tiny_model, tmp_path_factory) -> None:
    path = tiny_model("llama")[0]
    logs = tmp_path_factory.mktemp("spec_pd")
    role = ("--disaggregation-timeout", "3", "--disaggregation-mode")
    with mock.patch.dict(os.environ, {"SHARDSERVE_DIST_SECRET": SECRET}):
        servers = start({"ref": ("--model", path, *COMMON), "p": ("--model", path, *COMMON, *SPEC, *role, "prefill"),
                         "d": ("--model", path, *COMMON, *SPEC, *role, "decode")}, logs, {})
    router = RouterProc("--prefill", servers["p"].url, "--decode", servers["d"].url, "--model", path,
                        "--page-size", "8", "--health-interval", "0.5", log_path=str(logs / "router.log"))
    try:
        def healthy() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(router.url + "/health", timeout=2).status_code == 200
            return False

        wait_for(healthy, 60, "the router's /health to answer 200")
        for prompt in PROMPTS:
            assert completion(router.url, prompt=prompt)["choices"] == completion(servers["ref"].url,
                                                                                  prompt=prompt)["choices"]
        assert bootstrap(servers["p"])  # the prefill instance served them
        assert metrics(servers["d"].url)[("shardserve_spec_decode_num_accepted_tokens", (("method", "ngram"),))] > 0
        assert "speculative decoding is off on a prefill instance" in servers["p"].read_log()
    finally:
        router.proc.terminate()
        router.proc.wait(15)
        router.log.close()
        for s in servers.values():
            code, left = s.stop()
            assert code == 0 and left == []
