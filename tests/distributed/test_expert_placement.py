"""Hot-expert replicas (EPLB): balanced placements, routing-count files, the placement plan, and
the engine's routing counts. Pure python except the last test (one in-process engine)."""

from __future__ import annotations

import json

import pytest

from shardserve.config import EngineConfig
from shardserve.distributed.expert_placement import (
    Placement,
    PlacementPlan,
    load_counts,
    max_over_mean,
    save_counts,
)
from shardserve.layers.sharding import split_range
from shardserve.sampling_params import SamplingParams
from shardserve.scheduler.engine_core import EngineCore

# 8 experts on 4 ranks, two of them (0 and 1, both on rank 0) hot.
SKEWED = [100, 80, 5, 5, 5, 5, 5, 5]


def test_contiguous_is_todays_split():
    for experts in range(1, 10):
        for ranks in range(1, experts + 1):
            p = Placement.contiguous(experts, ranks)
            assert p.slots == tuple(tuple(range(*split_range(experts, ranks, r))) for r in range(ranks))
            assert p.copies() == [1] * experts
    with pytest.raises(ValueError, match="3 experts cannot be split over 4 ranks"):
        Placement.contiguous(3, 4)


def test_balanced_copies_the_hottest_experts_onto_the_least_loaded_ranks():
    p = Placement.balanced(SKEWED, 4, 2)
    # The two copies go to the two hot experts, on ranks that did not hold them, one per rank.
    assert p.copies() == [2, 2, 1, 1, 1, 1, 1, 1]
    assert p.slots == ((0, 1), (2, 3, 0), (4, 5, 1), (6, 7))
    assert p.owners(0) == ((0, 0), (1, 2)) and p.owners(1) == ((0, 1), (2, 2)) and p.owners(2) == ((1, 0),)
    assert p.expected_load(SKEWED) == [90.0, 60.0, 50.0, 10.0]
    # Three copies: the hottest per copy is now expert 0 again (100 / 2 > 80 / 2), on rank 3.
    assert Placement.balanced(SKEWED, 4, 3).slots == ((0, 1), (2, 3, 0), (4, 5, 1), (6, 7, 0))


def test_balanced_lowers_max_over_mean_and_never_doubles_an_expert_on_a_rank():
    before = Placement.contiguous(8, 4).imbalance(SKEWED)
    assert before == pytest.approx(180 / 52.5)
    last = before
    for redundant in (2, 3, 6):
        p = Placement.balanced(SKEWED, 4, redundant)
        assert p.num_slots == 8 + redundant
        assert all(len(set(s)) == len(s) for s in p.slots)
        # Extras are spread: no rank gets more than ceil(redundant / ranks) of them.
        assert max(len(s) for s in p.slots) - 2 <= -(-redundant // 4)
        assert p.imbalance(SKEWED) < last
        last = p.imbalance(SKEWED)
    assert last < 1.1
    # Total load is conserved whatever the placement.
    assert sum(Placement.balanced(SKEWED, 4, 6).expected_load(SKEWED)) == pytest.approx(sum(SKEWED))


def test_balanced_edge_cases():
    assert Placement.balanced(SKEWED, 4, 0) == Placement.contiguous(8, 4)
    assert Placement.balanced([0] * 4, 2, 2).num_slots == 6  # no tokens at all: still valid
    assert Placement.balanced([5, 9], 2, 2).slots == ((0, 1), (1, 0))  # every rank holds everything
    with pytest.raises(ValueError, match="room for at most 2 copies"):
        Placement.balanced([5, 9], 2, 3)
    with pytest.raises(ValueError, match="routing counts must be >= 0"):
        Placement.balanced([5, -1], 2, 1)
    assert max_over_mean([0, 0]) == 1.0 and max_over_mean([3, 1]) == 1.5


def test_placement_validation():
    with pytest.raises(ValueError, match="rank 1 holds an expert twice"):
        Placement(3, ((0,), (1, 2, 1)))
    with pytest.raises(ValueError, match=r"experts \[2\] have no slot"):
        Placement(3, ((0,), (1,)))
    with pytest.raises(ValueError, match="outside"):
        Placement(2, ((0,), (1, 2)))


def test_counts_file_round_trip_and_errors(tmp_path):
    path = str(tmp_path / "counts.json")
    save_counts(path, {3: [1, 2, 3], 1: [0, 0, 7]}, 3, "tiny")
    got = load_counts(path, 3)
    assert (got.num_experts, got.model, got.layers) == (3, "tiny", {1: [0, 0, 7], 3: [1, 2, 3]})
    assert json.load(open(path)) == {"num_experts": 3, "model": "tiny", "layers": {"1": [0, 0, 7], "3": [1, 2, 3]}}
    with pytest.raises(ValueError, match="layer 1: 2 counts, expected 3"):
        save_counts(path, {1: [1, 2]}, 3, "tiny")
    with pytest.raises(ValueError, match=r"^expert placement file .*nope.json does not exist$"):
        load_counts(str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match="counts 3 experts, the model has 8"):
        load_counts(path, 8)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_counts(str(bad))
    bad.write_text('{"layers": {}}')
    with pytest.raises(ValueError, match="is not a routing-count file"):
        load_counts(str(bad))
    bad.write_text('{"num_experts": 3, "model": "m", "layers": {"0": [1, 2]}}')
    with pytest.raises(ValueError, match="layer 0 has 2 counts, expected 3 non-negative ones"):
        load_counts(str(bad))


def test_placement_plan():
    assert PlacementPlan(4).for_layer(5, 8) == Placement.contiguous(8, 4)
    plan = PlacementPlan(4, 2, {0: SKEWED})
    assert plan.for_layer(0, 8) == Placement.balanced(SKEWED, 4, 2)
    with pytest.raises(ValueError, match="no routing counts for MoE layer 1"):
        plan.for_layer(1, 8)
    with pytest.raises(ValueError, match="layer 0 has 8 counts, the model has 6 experts"):
        plan.for_layer(0, 6)
    msg = r"^--ep-num-redundant-experts needs --ep-expert-placement \(write one with shardserve record-experts\)$"
    with pytest.raises(ValueError, match=msg):
        PlacementPlan(4, 2)


def test_engine_counts_routing_and_refuses_replicas_without_ep(tiny_model):
    """One process (no expert parallelism): every routed pair is computed here."""
    path, model = tiny_model("qwen3_moe")
    core = EngineCore(EngineConfig(model=path, show_progress=False, num_pages=64))
    experts = core.runner.model_cfg.num_experts
    assert core.runner.expert_counts() == {"routed": {0: [0] * experts, 1: [0] * experts}, "computed": {0: 0, 1: 0}}
    core.add_request("a", list(range(7)), SamplingParams(max_tokens=3, temperature=0))
    while core.has_unfinished():
        core.step()
    counts = core.runner.expert_counts()
    top_k = model.config.num_experts_per_tok
    for layer in (0, 1):  # 7 prompt tokens and 2 decoded ones went through each layer
        assert sum(counts["routed"][layer]) == counts["computed"][layer] == 9 * top_k
    with pytest.raises(ValueError, match=r"^--ep-num-redundant-experts needs --ep-size > 1$"):
        EngineCore(EngineConfig(model=path, show_progress=False, num_pages=64, ep_num_redundant_experts=2))


def test_record_experts_counts_each_token_once_on_any_layout(tiny_model, tmp_path):
    """`shardserve record-experts` writes every MoE layer's counts; one rank and EP 2 (two tensor
    ranks that each route every token, then dispatch a share) record the same routing."""
    from shardserve.cli.main import main

    path, model = tiny_model("qwen3_moe")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox\njumps over\n\nthe lazy dog\n")
    files = []
    for i, layout in enumerate(([], ["--tp-size", "2", "--ep-size", "2"])):
        out = tmp_path / f"counts{i}.json"
        argv = ["record-experts", "--model", path, "--output", str(out), "--prompts", str(prompts),
                "--max-tokens", "6", "--num-pages", "64", *layout]
        assert main(argv) == 0
        files.append(load_counts(str(out), model.config.num_experts))
    first = files[0].layers
    assert sorted(first) == list(range(model.config.num_hidden_layers))
    assert all(f.layers == first for f in files[1:])
    totals = {sum(c) for c in first.values()}  # every layer sees every token, top-k times
    assert len(totals) == 1 and totals.pop() % model.config.num_experts_per_tok == 0
    assert main(["record-experts", "--model", tiny_model("llama")[0], "--output", str(tmp_path / "x.json")]) == 2
