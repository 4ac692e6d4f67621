"""Data-parallel replicas (--dp-size): the same greedy tokens as one replica, through the offline
API and the server; the cache-aware router keeps a shared prefix on one replica (usage's cached
tokens show it); every replica is in /metrics. A dead replica: test_replica_restart.py."""

from __future__ import annotations

import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from shardserve import LLM, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from server_util import Server  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0)


def prompts(vocab: int, count: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(vocab, (n,), generator=g).tolist() for n in (1, 9, 30, 17, 4, 25)[:count]]


def transformers_tokens(model, batch: list[list[int]], new: int) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False)[0, len(p):].tolist() for p in batch]


@pytest.mark.parametrize("arch,dp,tp,method", [("llama", 2, 1, "cache_aware"), ("qwen2_moe", 2, 2, "round_robin"),
                                                ("qwen3", 3, 1, "least_load")])
def test_llm_replicas_match_transformers(tiny_model, arch, dp, tp, method):
    path, model = tiny_model(arch)
    batch = prompts(model.config.vocab_size)
    with LLM(path, dp_size=dp, tp_size=tp, load_balance_method=method, num_pages=64, page_size=8,
             show_progress=False) as llm:
        outs = [o.token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
        reports = llm.rank_reports()
        stats = llm.stats()
    assert outs == transformers_tokens(model, batch, 12)
    assert [r["rank"] for r in reports] == list(range(dp * tp))  # every replica's ranks answered
    assert stats.finished == len(batch)


def test_bad_replica_settings_are_refused(tiny_model):
    path, _ = tiny_model("llama")
    with pytest.raises(ValueError, match="--load-balance-method must be one of"):
        LLM(path, dp_size=2, load_balance_method="random")
    with pytest.raises(ValueError, match="--load-balance-method round_robin needs --dp-size > 1"):
        LLM(path, load_balance_method="round_robin")
    with pytest.raises(ValueError, match="--dp-size 2 with --nnodes 2"):
        LLM(path, dp_size=2, nnodes=2, dist_init_addr="127.0.0.1:29999")


def replica_metric(text: str, name: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf'{name}\{{replica="(\d+)"\}} (\S+)', text)}


def routed_once_settled(url: str, total: int) -> tuple[dict[str, float], str]:
    """Per-replica routed counts once the router's report has caught up with `total` requests
    (it reports at most every 0.25 s while busy, and at once when all replicas fall idle)."""
    deadline = time.monotonic() + 5
    while True:
        text = httpx.get(url + "/metrics").text
        routed = replica_metric(text, "shardserve_replica_routed_requests")
        if sum(routed.values()) >= total or time.monotonic() > deadline:
            return routed, text
        time.sleep(0.1)


@pytest.mark.slow
def test_dp2_server_same_text_and_prefix_affinity(tiny_model, tmp_path):
    path, model = tiny_model("llama")
    server = Server("--model", path, "--dp-size", "2", "--num-pages", "128", "--page-size", "8",
                    log_path=str(tmp_path / "log"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        batch = prompts(model.config.vocab_size)
        ref = transformers_tokens(model, batch, 12)
        tokenizer = AutoTokenizer.from_pretrained(path)

        def one(i: int) -> str:
            r = client.completions.create(model=None, prompt=batch[i % len(batch)], max_tokens=12, temperature=0)
            return r.choices[0].text

        with ThreadPoolExecutor(8) as pool:  # many at once: both replicas busy
            texts = list(pool.map(one, range(24)))
        assert texts == [tokenizer.decode(ref[i % len(batch)], skip_special_tokens=True) for i in range(24)]

        # Two groups sharing 48-token prefixes, one request at a time: each group's later requests
        # find their prefix cached (on the replica that computed it), and the groups split.
        g = torch.Generator().manual_seed(9)
        prefixes = [torch.randint(model.config.vocab_size, (48,), generator=g).tolist() for _ in range(2)]
        cached = []
        for i in range(6):
            prompt = prefixes[i % 2] + [i + 1, i + 2]
            r = client.completions.create(model=None, prompt=prompt, max_tokens=2, temperature=0)
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
        assert cached[:2] == [0, 0] and all(c >= 48 for c in cached[2:]), cached
        routed, metrics = routed_once_settled(server.url, 30)
        assert set(routed) == {"0", "1"} and sum(routed.values()) == 30 and min(routed.values()) >= 3, routed
        # Every request ended: the router's books are back to zero (no lost "ended" event).
        assert replica_metric(metrics, "shardserve_replica_load_tokens") == {"0": 0.0, "1": 0.0}
        assert len(replica_metric(metrics, "shardserve_replica_kv_pages_used")) == 2
        hit = float(re.search(r"^shardserve_prefix_cache_hit_rate (\S+)", metrics, re.M).group(1))
        assert hit > 0
    finally:
        code, left = server.stop()
    assert code == 0 and left == []
