"""`shardserve bench dist` is deterministic: every request is admitted before the first step,
so steps and tensor-group calls follow from the shapes alone, on every rank."""

from __future__ import annotations

import json

from shardserve.server.cli import main

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
