"""The rank grid against hand-written tables, and every size it must refuse."""

from __future__ import annotations

import pytest

from shardserve.distributed.layout import Coords, Layout, LayoutError


def test_dp2_pp2_tp2_by_hand():
    grid = Layout(dp=2, pp=2, tp=2)
    assert grid.world == 8
    # rank: (dp, pp, tp), tp fastest
    table = {0: (0, 0, 0), 1: (0, 0, 1), 2: (0, 1, 0), 3: (0, 1, 1),
             4: (1, 0, 0), 5: (1, 0, 1), 6: (1, 1, 0), 7: (1, 1, 1)}
    for rank, (dp, pp, tp) in table.items():
        assert grid.coords(rank) == Coords(dp=dp, pp=pp, cp=0, tp=tp)
        assert grid.rank_of(grid.coords(rank)) == rank
    assert grid.all_groups("tensor") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert grid.all_groups("pipeline") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert grid.all_groups("data") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert grid.all_groups("control") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert grid.groups_of(5) == {"tensor": (4, 5), "context": (5,), "pipeline": (5, 7), "data": (1, 5),
                                 "control": (4, 5, 6, 7), "expert": (5,), "moe_tp": (5,)}


def test_context_groups_sit_between_tensor_and_pipeline():
    grid = Layout(pp=2, cp=2, tp=2)
    assert grid.all_groups("tensor") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert grid.all_groups("context") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert grid.all_groups("pipeline") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert grid.all_groups("control") == [tuple(range(8))]


@pytest.mark.parametrize("ep, expert, moe_tp", [
    (4, [(0, 1, 2, 3)], [(0,), (1,), (2,), (3,)]),       # every rank its own experts, all-to-all over 4
    (2, [(0, 2), (1, 3)], [(0, 1), (2, 3)]),             # 2 expert groups, experts split over 2 ranks
])
def test_expert_groups_redivide_the_moe_span(ep, expert, moe_tp):
    grid = Layout(dp=2, tp=2, ep=ep)
    assert grid.moe_span == 4 and grid.moe_tp == 4 // ep
    assert grid.all_groups("expert") == expert
    assert grid.all_groups("moe_tp") == moe_tp


def test_expert_groups_per_pipeline_stage():
    grid = Layout(pp=2, tp=2, ep=2)
    assert grid.all_groups("expert") == [(0, 1), (2, 3)]


def test_nodes_take_contiguous_blocks():
    grid = Layout(pp=2, tp=2, nnodes=2)
    assert [grid.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [grid.local_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert list(grid.node_ranks(1)) == [2, 3]


def test_creation_order_is_the_same_for_every_rank_and_skips_singletons():
    grid = Layout(dp=2, pp=2, tp=2)
    order = grid.creation_order()
    assert [k for k, _ in order][:4] == ["tensor"] * 4
    assert all(len(g) > 1 for _, g in order)
    assert order == Layout(dp=2, pp=2, tp=2).creation_order()
    assert Layout().creation_order() == []


@pytest.mark.parametrize("sizes, message", [
    (dict(tp=0), "--tp-size must be an integer >= 1, got 0"),
    (dict(pp=-1), "--pp-size must be an integer >= 1, got -1"),
    (dict(tp=3, nnodes=2), "--nnodes 2 does not divide the 3 ranks (dp 1 x pp 1 x cp 1 x tp 3)"),
    (dict(dp=3, tp=2, ep=4), "--ep-size 4 does not divide the 6 ranks the MoE layers span (dp 3 x cp 1 x tp 2)"),
])
def test_impossible_sizes_are_refused_naming_the_flag(sizes, message):
    with pytest.raises(LayoutError) as e:
        Layout(**sizes)
    assert str(e.value) == message


@pytest.mark.parametrize("sizes, model, message", [
    (dict(pp=3), (2, 4, 0), "--pp-size 3 exceeds the model's 2 layers"),
    (dict(tp=8), (2, 4, 0), "--tp-size 8 exceeds the model's 4 attention heads"),
    (dict(tp=2, ep=2), (2, 4, 0), "--ep-size 2 needs a mixture-of-experts model"),
    (dict(dp=2, tp=4, ep=8), (2, 4, 6), "--ep-size 8 exceeds the model's 6 experts"),
])
def test_sizes_the_model_cannot_take(sizes, model, message):
    with pytest.raises(LayoutError) as e:
        Layout(**sizes).check_model(*model)
    assert str(e.value) == message


def test_world_size_from_a_launcher_must_agree():
    with pytest.raises(LayoutError, match="WORLD_SIZE is 3 but the layout has 2 ranks"):
        Layout(tp=2).check_world(3, "WORLD_SIZE")


def test_context_parallel_sizes_from_flags():
    grid = Layout.from_sizes(tp=2, pp=2, cp=2)
    assert (grid.tp, grid.pp, grid.cp, grid.world) == (2, 2, 2, 8)
    with pytest.raises(LayoutError, match="--cp-size 2 with --ep-size is not supported"):
        Layout.from_sizes(tp=2, cp=2, ep=2)
    with pytest.raises(LayoutError, match="--cp-size 2 with --enable-dp-attention is not supported"):
        Layout.from_sizes(tp=2, dp=2, cp=2, dp_attention=True)
