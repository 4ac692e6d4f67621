"""`shardserve bench dist` is deterministic: every request is admitted before the first step,
so steps and tensor-group calls follow from the shapes alone, on every rank."""

from __future__ import annotations

import json

from shardserve.cli.main import main

LAYERS, NEW = 2, 5


def test_bench_dist_counts_follow_from_the_shapes(capsys):
    argv = ["bench", "dist", "--layers", str(LAYERS), "--hidden", "64", "--heads", "4", "--kv-heads", "2",
            "--intermediate", "96", "--vocab", "301", "--num-prompts", "6", "--prompt-len", "20",
            "--new-tokens", str(NEW), "--tp-sizes", "1,2", "--kv-cache-memory", "4M"]
    assert main(argv) == 0
    runs = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["ranks"] for r in runs] == [1, 2]
    assert all(r["same_tokens"] and r["mode"] == "tensor" for r in runs)
    assert [r["steps"] for r in runs] == [NEW, NEW]  # one prefill step for all six, then decodes
    tp2 = runs[1]
    per_step = 1 + 2 * LAYERS  # embedding, then attention and MLP outputs of each layer
    assert tp2["traffic"]["all_reduce"]["calls"] == NEW * per_step
    assert tp2["traffic"]["all_gather"]["calls"] == NEW  # the LM head; its sizes are known, not exchanged
    assert len(tp2["traffic_per_rank"]) == 2
    for rank in tp2["traffic_per_rank"]:
        assert rank["tensor"] == tp2["traffic"]  # every rank runs the same collectives
        assert set(rank) == {"tensor", "control"}
    assert runs[0]["traffic_per_rank"] == [{}]


def test_bench_dist_pipeline_counts_follow_from_the_shapes(capsys):
    """PP 2 and 3 with one micro-batch: every step's residual stream crosses each boundary once;
    PP 2 with the default micro-batches: the same tokens and bytes, in more (smaller) sends."""
    prompts, prompt_len, hidden = 6, 20, 64
    common = ["bench", "dist", "--mode", "pipeline", "--layers", "5", "--hidden", str(hidden), "--heads", "4",
              "--kv-heads", "2", "--intermediate", "96", "--vocab", "301", "--num-prompts", str(prompts),
              "--prompt-len", str(prompt_len), "--new-tokens", str(NEW), "--sizes", "1,2,3", "--kv-cache-memory", "4M"]
    assert main([*common, "--pp-micro-batches", "1"]) == 0
    one = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    # PP 1 with the default micro-batches is the run above, and PP 3 adds nothing PP 2 does not
    # show here (test_pipeline runs 3 micro-batches): the second run is PP 2 alone (CI time).
    assert main([*common[:-3], "2", *common[-2:]]) == 0
    default = one[:1] + [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    tokens = prompts * prompt_len + (NEW - 1) * prompts
    for runs in (one, default):
        n = len(runs)  # 3, then 2
        assert [r["ranks"] for r in runs] == [1, 2, 3][:n] and all(r["same_tokens"] for r in runs)
        assert [r["layers_per_rank"] for r in runs] == [[[0, 5]], [[0, 3], [3, 5]], [[0, 2], [2, 4], [4, 5]]][:n]
        # A page of one layer: K and V, 16 tokens x 2 KV heads x 16 dims x 4 bytes. Every rank uses
        # what the stage with the most layers holds (5, then 3, then 2).
        per_layer = 2 * 16 * 2 * 16 * 4
        assert [r["kv_pages_per_rank"] for r in runs] == [4 * 2**20 // (k * per_layer) for k in (5, 3, 2)][:n]
        for r in runs[1:]:
            assert r["pipeline"]["send"]["MB"] == tokens * hidden * 4 / 1e6
            assert r["control"]["plan_fanout"]["calls"] == r["steps"] + 1  # the plans, and the report request
            assert r["traffic_per_rank"][-1]["control"]["result"]["calls"] == r["steps"]  # tokens back
    assert [r["steps"] for r in one] == [NEW] * 3
    assert [r["pipeline"]["send"]["calls"] for r in one[1:]] == [NEW, NEW]
    # Six requests over 2 micro-batches of at most 3 each: at least twice the steps (more when a
    # slot is filled before every result is back), one send per step.
    assert default[0]["steps"] == NEW
    assert default[1]["steps"] >= 2 * NEW and default[1]["pipeline"]["send"]["calls"] == default[1]["steps"]


def test_bench_dist_expert_bytes_follow_from_the_routing(capsys):
    """EP 2 under data-parallel attention: each rank's all-to-all MB equals what the rows it
    dispatched and received imply; TP 2 beside it; redundant experts keep the tokens and do not
    raise the per-rank load's max/mean on the skewed gate."""
    argv = ["bench", "dist", "--mode", "expert", "--layers", str(LAYERS), "--hidden", "64", "--heads", "4",
            "--kv-heads", "2", "--intermediate", "96", "--vocab", "301", "--num-prompts", "4", "--prompt-len", "20",
            "--new-tokens", str(NEW), "--sizes", "1,2", "--kv-cache-memory", "4M"]
    assert main(argv) == 0
    runs = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["mode"], r["ranks"]) for r in runs] == [("expert", 1), ("expert", 2), ("tensor", 2), ("redundant", 2)]
    assert all(r["same_tokens"] for r in runs)
    ep2 = runs[1]
    assert [rank["MB"] for rank in ep2["all_to_all"]] == ep2["predicted_MB"] and min(ep2["predicted_MB"]) > 0
    assert all(rank["calls"] == 2 * LAYERS * ep2["steps"] for rank in ep2["all_to_all"])  # lockstep
    assert runs[2]["all_reduce"][0]["MB"] > 0
    assert runs[3]["load_max_over_mean_with_replicas"] <= runs[3]["load_max_over_mean"]


def test_bench_dist_context_ring_bytes_follow_from_the_page_layout(capsys):
    """CP 1 and 2 on one 300-token prompt (19 pages, the last partial): the same tokens, each rank's
    ring bytes per layer (N - 1) x its own block, less attention work per rank than a contiguous
    split, and twice the longest prompt on the same pages per rank."""
    argv = ["bench", "dist", "--mode", "context", "--layers", str(LAYERS), "--hidden", "64", "--heads", "4",
            "--kv-heads", "2", "--intermediate", "96", "--vocab", "301", "--prompt-len", "300", "--sizes", "1,2"]
    assert main(argv) == 0
    *runs, summary = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["ranks"] for r in runs] == [1, 2] and summary["summary"]
    assert all(r["same_tokens"] and r["prefill_one_chunk"] for r in runs)
    cp2 = runs[1]
    assert cp2["keys_per_rank"] == [156, 144]  # pages 0 1 ... 1 0 at page grain: rank 0 holds the partial one
    per_key = 2 * 2 * 16 * 4 + 8  # K and V of 2 KV heads x 16 dims in fp32, and the position
    assert cp2["ring_bytes_per_layer"] == cp2["expected_ring_bytes_per_layer"] == [156 * per_key, 144 * per_key]
    assert cp2["ring_calls_per_rank"] == [LAYERS, LAYERS]
    assert cp2["work_max_over_mean"] < cp2["work_max_over_mean_contiguous"]
    assert [r["longest_prompt"] for r in runs] == [300, 604]  # 19 pages per rank, 4 tokens out
    assert "pool" in cp2["refusal"] and summary["prefill_seconds"].keys() == {"1", "2"}


def test_bench_dist_latent_dp_attention_holds_a_pool_per_rank(capsys):
    """The latent cache is one head: TP 4 keeps every token on every rank, DP attention 4 keeps
    each replica's own; with the same pool per rank, DP attention admits 4x the tokens and this
    workload (6 x 25 tokens, 2 pages each, against 4-page pools) runs at once where TP 4 queues it."""
    argv = ["bench", "dist", "--mode", "latent", "--layers", "2", "--hidden", "64", "--heads", "4",
            "--intermediate", "96", "--vocab", "301", "--num-prompts", "6", "--prompt-len", "20",
            "--new-tokens", str(NEW), "--sizes", "4", "--kv-cache-memory", "96K"]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    runs = {r["layout"]: r for r in lines if r["layout"] in ("tensor", "dp_attention")}
    tp, dpa = runs["tensor"], runs["dp_attention"]
    assert tp["same_tokens"] and dpa["same_tokens"]
    assert tp["kv_bytes_per_token_per_rank"] == 2 * (128 + 32) * 4  # layers x (kv_lora_rank + rope) x fp32
    assert (tp["kv_pages_per_rank"], dpa["kv_pages_per_rank"]) == (4, 4)
    assert (tp["server_kv_tokens"], dpa["server_kv_tokens"]) == (64, 256)
    assert tp["steps"] >= 2 * dpa["steps"] and dpa["preemptions"] == 0  # TP 4: two requests at a time
    assert min(tp["all_reduce_MB_per_step"]) > 0 and max(tp["all_to_all_MB_per_step"]) == 0
    assert min(dpa["all_to_all_MB_per_step"]) > 0 and max(dpa["all_reduce_MB_per_step"]) == 0
    compare = next(r for r in lines if r["layout"] == "compare")
    assert compare["tokens_per_rank_dp_attention_over_tensor"] == 4.0
    assert [r["context"] for r in lines if r["layout"] == "decode_cost"] == [16, 128, 1024, 8192]
