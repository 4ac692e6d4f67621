"""The communicator on 3 gloo ranks against single-process results, with exact traffic counts."""

from __future__ import annotations

import torch
from ranks import run_ranks

WORLD = 3


def data(rank: int, rows: int) -> torch.Tensor:
    return torch.arange(rows * 4, dtype=torch.float32).view(rows, 4) + 100 * rank


def collectives(comm):
    r = comm.rank
    summed = comm.all_reduce(data(r, 2).clone())
    low = comm.all_reduce(torch.tensor([5.0 + r]), op="min")
    even = comm.all_gather(data(r, 2), dim=0)
    uneven = comm.all_gather(data(r, r + 1), dim=0, sizes=[1, 2, 3])  # sizes known: no exchange
    comm.barrier()
    # Rank r sends r * dst rows to rank dst, tagged with sender and destination: rank 0 sends and
    # receives only empty pieces.
    pieces = [torch.full((r * dst, 2), float(10 * r + dst)) for dst in range(comm.size)]
    received = comm.all_to_all(pieces)
    b = comm.broadcast(torch.tensor([float(r)] * 3), src=1)
    return summed, low, even, uneven, received, b, comm.traffic_report()


def test_collectives_match_single_process():
    results = run_ranks(collectives, WORLD)
    total = sum(data(r, 2) for r in range(WORLD))
    for r, (summed, low, even, uneven, received, b, traffic) in enumerate(results):
        torch.testing.assert_close(summed, total)
        assert low.item() == 5.0
        torch.testing.assert_close(even, torch.cat([data(q, 2) for q in range(WORLD)]))
        torch.testing.assert_close(uneven, torch.cat([data(q, q + 1) for q in range(WORLD)]))
        for src, piece in enumerate(received):
            assert piece.shape == (src * r, 2) and (piece == 10 * src + r).all()
        assert b.tolist() == [1.0] * 3
        # Bytes this rank passed in: 2x4 fp32 for all_reduce + 1 fp32 for the min.
        assert traffic["all_reduce"] == {"calls": 2, "MB": (8 * 4 + 4) / 1e6}
        assert traffic["all_gather"] == {"calls": 2, "MB": (8 * 4 + (r + 1) * 4 * 4) / 1e6}
        sent = sum(r * dst * 2 * 4 for dst in range(WORLD) if dst != r)  # what leaves this rank
        assert traffic["all_to_all"] == {"calls": 1, "MB": sent / 1e6}
        # The row counts all_to_all exchanges first are a collective too, and counted.
        assert traffic["all_to_all_sizes"] == {"calls": 1, "MB": WORLD * 8 / 1e6}
        assert traffic["broadcast"] == {"calls": 1, "MB": 12 / 1e6}
        assert traffic["barrier"] == {"calls": 1, "MB": 0.0}
        assert set(traffic) == {"all_reduce", "all_gather", "all_to_all", "all_to_all_sizes", "broadcast",
                                "barrier"}


def failing_peer(comm):
    import os

    if comm.rank == 1:
        os._exit(3)  # dies without a word
    try:
        comm.all_reduce(torch.ones(4))
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def test_dead_peer_raises_named_error():
    [(kind, message)] = run_ranks(failing_peer, 2, timeout=60, report=1)
    assert kind == "CollectiveError"
    assert "rank 0: all_reduce on the test group failed" in message


def silent_stage(comm):
    """Rank 0 (stage 0) lives but never sends: rank 1's receive of the residual stream gives up."""
    import time

    from shardserve.distributed.communicator import Communicator
    from shardserve.distributed.pipeline import Stage, StageLink

    pipe = Communicator(comm.group, comm.rank, comm.size, "pipeline", comm.members)
    if comm.rank == 0:
        time.sleep(5)  # alive, silent, past rank 1's 2 s timeout
        return None
    link = StageLink(pipe, Stage(1, 2, 2, 4), timeout_s=2)
    start = time.monotonic()
    try:
        link.recv(4, 8, torch.float32, torch.device("cpu"))
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return None


def test_a_silent_stage_bounds_the_receive_and_names_it():
    [_, (kind, message, waited)] = run_ranks(silent_stage, 2, timeout=60, group_timeout=2)
    assert kind == "CollectiveError"
    assert message.startswith("rank 1: recv from rank 0 on the pipeline group failed")
    assert 1.5 < waited < 6
