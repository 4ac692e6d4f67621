"""Data-parallel attention (--enable-dp-attention): replicas with their own requests and KV cache,
MoE layers expert-parallel over every rank, all replicas stepping in lockstep.

Through the offline API: a request alone (every other replica idle for its whole run) and a batch
of very different lengths equal transformers' greedy tokens and log-probabilities; every rank ran
the same number of MoE all-to-alls (an idle replica joined with empty steps); refusals. Through
the server: concurrent openai requests equal transformers', and a killed rank ends the server
whole with the rank named.
"""

from __future__ import annotations

import os
import re
import signal
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
from server_util import LongStream, Server  # noqa: E402

NEW = 10
ENGINE = dict(num_pages=64, page_size=8, max_num_batched_tokens=32, show_progress=False)
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, logprobs=2)


def reference(model, prompt: list[int], new: int = NEW) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the log-probabilities of every position that chose one."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
        logits = model(out[:, :-1]).logits[0, len(prompt) - 1 :]
    return out[0, len(prompt) :].tolist(), torch.log_softmax(logits.float(), -1)


def assert_matches(model, outs, batch) -> None:
    for out, prompt in zip(outs, batch, strict=True):
        tokens, lps = reference(model, prompt)
        assert out.token_ids == tokens
        for entry, row in zip(out.logprobs, lps, strict=True):
            assert abs(entry["logprob"] - float(row[entry["token_id"]])) < 1e-4


def settled_stats(llm: LLM, idle_replicas: int):
    """The stats once the idle replicas' last reports (sent as all fall idle) are in."""
    deadline = time.monotonic() + 5
    while True:
        stats = llm.stats()
        if stats.empty_steps >= idle_replicas * stats.steps or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


# T 4 x D 2 (two ranks per replica) runs through the server below.
@pytest.mark.parametrize("arch,tp,dp", [("qwen3_moe", 2, 2), ("qwen2_moe", 3, 3)])
def test_dp_attention_matches_transformers(tiny_model, arch, tp, dp):
    path, model = tiny_model(arch)
    g = torch.Generator().manual_seed(5)
    alone = [torch.randint(model.config.vocab_size, (7,), generator=g).tolist()]
    # Very different token counts: one replica prefills 150 tokens in chunks while others decode.
    uneven = [torch.randint(model.config.vocab_size, (n,), generator=g).tolist() for n in (150, 1, 9, 3)]
    with LLM(path, tp_size=tp, dp_size=dp, enable_dp_attention=True, **ENGINE) as llm:
        assert llm.layout.tp == tp // dp and llm.layout.ep == tp  # SGLang's meaning of the sizes
        assert_matches(model, llm.generate(alone, GREEDY, use_tqdm=False), alone)
        idle = settled_stats(llm, dp - 1)
        assert_matches(model, llm.generate(uneven, GREEDY, use_tqdm=False), uneven)
        reports = llm.rank_reports()
    # The lone request ran on one replica; the others stepped empty beside it, never alone.
    assert idle.empty_steps >= (dp - 1) * idle.steps > 0
    assert [r["rank"] for r in reports] == list(range(tp))
    calls = {r["rank"]: r["groups"]["expert"]["all_to_all"]["calls"] for r in reports}
    assert len(set(calls.values())) == 1, calls  # lockstep: every rank ran every MoE layer's all-to-all
    leaders = [r for r in reports if r["rank"] % (tp // dp) == 0]
    assert all(r["groups"]["data"]["all_reduce"]["calls"] > 0 for r in leaders)  # the per-step agreement


def test_dp_attention_refusals(tiny_model):
    moe, _ = tiny_model("qwen3_moe")
    cases = [
        (dict(tp_size=2, dp_size=1), "--enable-dp-attention needs --dp-size > 1"),
        (dict(tp_size=3, dp_size=2), "--dp-size 2 must divide --tp-size 3"),
        (dict(tp_size=2, dp_size=2, ep_size=1, pp_size=2), "with --pp-size 2 is not supported"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(moe, enable_dp_attention=True, **kwargs)
    with pytest.raises(ValueError, match="--enable-dp-attention needs a mixture-of-experts model"):
        LLM(tiny_model("llama")[0], tp_size=2, dp_size=2, enable_dp_attention=True)
    with pytest.raises(ValueError, match="--ep-size 2 with --dp-size 2 needs --enable-dp-attention"):
        LLM(moe, tp_size=1, dp_size=2, ep_size=2)


@pytest.mark.slow
def test_dp_attention_server_matches_transformers_and_restarts_whole(tiny_model, tmp_path):
    """--tp-size 4 --dp-size 2: two replicas of two tensor ranks, experts over all four ranks. A
    rank's death stops both replicas (every MoE layer spans them): both start again, together."""
    path, model = tiny_model("qwen3_moe")
    server = Server("--model", path, "--tp-size", "4", "--dp-size", "2", "--enable-dp-attention",
                    "--num-pages", "64", "--page-size", "8", log_path=str(tmp_path / "log"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        g = torch.Generator().manual_seed(3)
        batch = [torch.randint(model.config.vocab_size, (n,), generator=g).tolist() for n in (1, 9, 30, 17, 4, 25)]
        tokenizer = AutoTokenizer.from_pretrained(path)
        expected = [tokenizer.decode(reference(model, p, 8)[0], skip_special_tokens=True) for p in batch]

        def one(i: int) -> str:
            p = batch[i % len(batch)]
            return client.completions.create(model=None, prompt=p, max_tokens=8, temperature=0).choices[0].text

        with ThreadPoolExecutor(8) as pool:  # many at once: both replicas busy, unevenly
            texts = list(pool.map(one, range(12)))
        assert texts == [expected[i % len(batch)] for i in range(12)]
        # /metrics: both replicas' routing counts, per layer and expert (each layer saw every token).
        # Wait for the leaders' reports as they fell idle: both replicas' counts cover all 12 requests.
        deadline = time.monotonic() + 30
        while True:
            metrics = httpx.get(server.url + "/metrics").text
            done = float(re.search(r"^shardserve_engine_requests_finished (\S+)$", metrics, re.M).group(1))
            if done >= 12:
                break
            assert time.monotonic() < deadline, f"the leaders reported {done} of 12 requests finished"
            time.sleep(0.1)
        routed: dict[str, float] = {}
        for m in re.finditer(r'shardserve_expert_routed_tokens\{expert="\d+",layer="(\d+)"\} (\S+)', metrics):
            routed[m.group(1)] = routed.get(m.group(1), 0.0) + float(m.group(2))
        assert set(routed) == {"0", "1"} and len(set(routed.values())) == 1, routed
        assert routed["0"] >= 12 * 8 * model.config.num_experts_per_tok  # at least every generated token's pairs
        assert "shardserve_engine_empty_steps" in metrics
        # Replica 1's leader (rank 2) dies mid-request: the request fails naming it, every rank
        # is started again, and both replicas serve the same answers.
        stream = LongStream(server.url, max_tokens=400)
        stream.wait_running()
        os.kill(server.last_pid("scheduler-2"), signal.SIGKILL)
        stream.assert_failed()
        assert any("stopped while this request was running" in e for e in stream.events), stream.events[-3:]
        server.wait_replica(0, "serving", restarts=1)
        body = server.wait_replica(1, "serving", restarts=1)
        assert body["status"] == "ok"
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(6))) == expected
        log = server.read_log()
        assert "replicas 0, 1: scheduler-2 (dp 1, tp 0) was killed by signal 9; " in log, log[-3000:]
        assert "starting them again in 0 s" in log and "replicas 0, 1 are serving again (restart 1)" in log
        # The other ranks were inside a collective with it: they stop, naming themselves and it.
        assert re.search(r"rank [013]: \S+ on the (expert|data|tensor) group failed", log), log[-3000:]
    finally:
        code, left = server.stop()
    assert code == 0 and left == []
