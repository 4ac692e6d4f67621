"""`shardserve bench serve` against a live server on the tiny Llama: every request succeeds, token
counts are exact, and the latency percentiles are ordered."""

from __future__ import annotations

import json

import pytest
from server_util import Server

from shardserve.cli.main import main

NUM_REQUESTS = 8
MAX_OUTPUT = 12


def last_json(out: str) -> dict:
    """The final JSON line the benchmark prints."""
    return json.loads(out.strip().splitlines()[-1])


def assert_ordered(stats: dict) -> None:
    assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], stats
    assert stats["mean"] > 0


def test_bench_serve_against_tiny_server(tiny_model, tmp_path, capsys):
    from shardserve.bench.serve import make_requests, resolve_ranges
    from shardserve.cli.main import build_parser

    path, _ = tiny_model("llama")
    server = Server("--model", path, "--num-pages", "128", log_path=str(tmp_path / "server.log"))
    try:
        argv = ["bench", "serve", "--url", server.url, "--num-requests", str(NUM_REQUESTS), "--max-prompt", "40",
                "--max-output", str(MAX_OUTPUT), "--request-rate", "20"]
        assert main(argv) == 0
        result = last_json(capsys.readouterr().out)
    finally:
        code, left = server.stop()
    assert left == [], f"processes left behind: {left}"
    assert code == 0, server.read_log()[-3000:]

    args = build_parser().parse_args(argv)
    resolve_ranges(args)
    requested = sum(r.output_len for r in make_requests(args))
    assert result["requests"] == NUM_REQUESTS and result["failed"] == 0
    assert result["output_tokens"] == result["requested_output_tokens"] == requested
    assert result["prompt_tokens"] > 0 and result["stopped_early"] == 0
    assert result["request_throughput"] > 0 and result["output_tokens_per_s"] > 0 and result["duration_s"] > 0
    for key in ("ttft_ms", "itl_ms", "e2e_latency_ms"):
        assert_ordered(result[key])


def test_workload_and_arrivals_are_seeded():
    from shardserve.bench.serve import arrival_times, make_requests, resolve_ranges
    from shardserve.cli.main import build_parser

    args = build_parser().parse_args(["bench", "serve", "--url", "x", "--num-requests", "50", "--max-output", "8"])
    resolve_ranges(args)
    assert (args.min_output, args.max_output, args.min_prompt, args.max_prompt) == (8, 8, 32, 256)
    reqs = make_requests(args)
    assert reqs == make_requests(args) and all(32 <= len(r.prompt.split()) <= 256 for r in reqs)
    assert arrival_times(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    times = arrival_times(2000, 10.0, 0)
    assert times == arrival_times(2000, 10.0, 0) and times == sorted(times)
    assert abs(times[-1] / 1999 - 0.1) < 0.01  # mean gap 1/rate


def test_stream_timer_counts_text_chunks_without_usage():
    from shardserve.bench.serve import StreamTimer

    timer = StreamTimer(0.0)
    timer.add({"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}, 0.5)
    for t in (1.0, 1.25, 1.75):
        timer.add({"choices": [{"delta": {"content": "a"}, "finish_reason": None}]}, t)
    timer.add({"choices": [{"delta": {}, "finish_reason": "stop"}]}, 2.0)
    r = timer.result(2.5)
    assert (r.ok, r.ttft, r.itls, r.latency, r.output_tokens, r.prompt_tokens) == (True, 1.0, [0.25, 0.5], 2.5, 3,
                                                                                    None)
    assert r.finish_reason == "stop"


@pytest.mark.slow
def test_shared_prefix_bench_compares_policies_side_by_side(tiny_model, capsys):
    """The cache-aware router serves (nearly) the ideal share of prompt tokens from cache; round
    robin recomputes each group's prefix on both replicas. Servers started and stopped by the bench."""
    path, _ = tiny_model("llama")
    argv = ["bench", "serve", "--workload", "shared-prefix", "--spawn",
            f"--model {path} --dp-size 2 --num-pages 256 --page-size 8", "--policies", "cache_aware,round_robin",
            "--num-requests", "12", "--num-groups", "3", "--prefix-words", "40", "--suffix-words", "4",
            "--max-output", "2", "--request-rate", "10"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    runs = {r["label"]: r for r in map(json.loads, out.strip().splitlines()[-2:])}
    aware, rr = runs["dp server, cache_aware"], runs["dp server, round_robin"]
    assert aware["requests"] == rr["requests"] == 12 and aware["failed"] == rr["failed"] == 0
    assert aware["ideal_hit_rate"] > 0.5
    assert aware["hit_rate"] >= 0.85 * aware["ideal_hit_rate"], aware
    assert aware["hit_rate"] > rr["hit_rate"], (aware, rr)
    assert len(aware["prompt_tokens_per_target"]) == 2 and aware["imbalance"] >= 1.0
    assert "TTFT mean" in out
