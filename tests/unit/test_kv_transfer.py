"""KV transfer between instances (kvcache/transfer.py, engine/kv_shipper.py), in one process:
prefill ranks ship a prompt's KV layer by layer over real CURVE TCP channels, decode ranks with
another tensor-parallel size write it into their own pages, heads re-split on arrival."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from shardserve.engine.kv_shipper import KVShipper
from shardserve.ipc.messages import decode
from shardserve.ipc.messages.disagg import KVArrived, KVTarget
from shardserve.ipc.messages.plan import PlanEntry
from shardserve.kvcache.transfer import KVReceiver, KVSender, sender_heads
from shardserve.layers.sharding import head_shard

SECRET = b"test-secret-0123456789"
HEADS, KV_HEADS, DIM, LAYERS = 6, 3, 4, 3


def pool(pages: int, page_size: int, kv_heads: int, fill: bool, widths: tuple[int, int] = (DIM, DIM)):
    make = torch.randn if fill else torch.zeros
    return [(make(pages * page_size, kv_heads, widths[0]), make(pages * page_size, kv_heads, widths[1]))
            for _ in range(LAYERS)]


def free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_sender_heads_each_head_once():
    """Each KV head a decode rank needs comes from exactly one prefill rank (the lowest holding it)."""
    ranges = [(s.kv_start, s.kv_end) for s in (head_shard(HEADS, KV_HEADS, 2, r) for r in range(2))]
    assert ranges == [(0, 2), (1, 3)]  # head 1 is held by both prefill ranks
    for want in [(0, 3), (0, 1), (1, 2), (2, 3), (1, 3)]:
        got = [sender_heads(KV_HEADS, ranges, r, want) for r in range(2)]
        covered = [h for a, b in got for h in range(a, b)]
        assert sorted(covered) == list(range(*want))
    assert sender_heads(KV_HEADS, ranges, 1, (1, 2)) == (0, 0)  # rank 0 sends head 1


# The last case is latent attention's pool: one KV head every rank holds, K 24 wide, V empty.
@pytest.mark.parametrize("p_tp, d_tp, kv_heads, widths", [(1, 3, KV_HEADS, (DIM, DIM)), (2, 1, KV_HEADS, (DIM, DIM)),
                                                          (2, 3, KV_HEADS, (DIM, DIM)), (2, 3, 1, (24, 0))])
def test_prompt_kv_moves_layer_by_layer_and_resplits(p_tp, d_tp, kv_heads, widths):
    p_ps, d_ps, tokens = 4, 8, 27  # different page sizes too: pages are addressed by position
    p_pages, d_pages = [5, 2, 7, 1, 3, 0, 6], [3, 1, 0, 2]  # any order: the page tables say
    ports = free_ports(d_tp)
    notify = zmq.Context.instance().socket(zmq.PULL)
    notify_port = notify.bind_to_random_port("tcp://127.0.0.1")
    # The prefill instance's pools, full heads then each rank's slice (replicated heads agree).
    full = pool(8, p_ps, kv_heads, fill=True, widths=widths)
    d_shards = [head_shard(HEADS, kv_heads, d_tp, r) for r in range(d_tp)]
    d_pools = [pool(4, d_ps, s.num_kv, fill=False, widths=widths) for s in d_shards]
    receivers = [KVReceiver(d_pools[r], d_ps, d_shards[r].kv_start, f"tcp://127.0.0.1:{ports[r]}", SECRET,
                            f"tcp://127.0.0.1:{notify_port}", r, ctx=zmq.Context()) for r in range(d_tp)]
    # (a context each: one ZAP handler per context, as one receiver per process has)
    target = KVTarget("room-1", "127.0.0.1", ports, [(s.kv_start, s.kv_end) for s in d_shards], d_pages, d_ps)
    senders = []
    try:
        for r in range(p_tp):
            s = head_shard(HEADS, kv_heads, p_tp, r)
            views = [(k[:, s.kv_start:s.kv_end], v[:, s.kv_start:s.kv_end]) for k, v in full]
            sender = KVSender(SECRET, 5.0)
            senders.append(sender)
            ship = KVShipper(sender, views, p_ps, HEADS, kv_heads, p_tp, r, torch.device("cpu"))
            for start, n in [(0, 16), (16, 11)]:  # two prefill chunks
                entry = PlanEntry("room-1", start, list(range(n)), 0, [], start + n == tokens)
                assert ship.plan([entry], {"room-1": p_pages}, {"room-1": target})
                for layer in range(LAYERS):
                    ship.after_layer(layer)
                ship.finish()
        arrived = set()
        deadline = time.monotonic() + 10
        while len(arrived) < d_tp and notify.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            msg = decode(notify.recv())
            assert isinstance(msg, KVArrived) and msg.room == "room-1"
            arrived.add(msg.rank)
        assert arrived == set(range(d_tp))
        pos = torch.arange(tokens)
        src = torch.tensor(p_pages)[pos // p_ps] * p_ps + pos % p_ps
        dst = torch.tensor(d_pages)[pos // d_ps] * d_ps + pos % d_ps
        for r, s in enumerate(d_shards):
            for layer in range(LAYERS):
                for got, want in zip(d_pools[r][layer], full[layer]):
                    torch.testing.assert_close(got[dst], want[src][:, s.kv_start:s.kv_end], rtol=0, atol=0)
        # Each decode rank got each of its heads once: bytes = layers x tokens x heads x (K + V
        # width) x 4 (float32); a head several decode ranks hold (the latent: all) goes to each.
        for sender in senders:
            sender.close()
        wanted = LAYERS * tokens * sum(s.num_kv for s in d_shards) * sum(widths) * 4
        assert sum(s.stats.bytes for s in senders) == wanted == sum(rc.bytes for rc in receivers)
        assert all(s.stats.requests == 1 and s.stats.failed == 0 for s in senders if s.stats.bytes)
    finally:
        for rc in receivers:
            rc.close()
        notify.close(linger=0)


def test_cancelled_room_is_never_written():
    """After `cancel`, a late frame of the room leaves the pages alone (they may be someone else's)."""
    port, = free_ports(1)
    notify = zmq.Context.instance().socket(zmq.PULL)
    notify_port = notify.bind_to_random_port("tcp://127.0.0.1")
    d_pool = pool(2, 4, KV_HEADS, fill=False)
    rc = KVReceiver(d_pool, 4, 0, f"tcp://127.0.0.1:{port}", SECRET, f"tcp://127.0.0.1:{notify_port}", 0,
                    ctx=zmq.Context())
    sender = KVSender(SECRET, 5.0)
    try:
        rc.cancel("gone")
        target = KVTarget("gone", "127.0.0.1", [port], [(0, KV_HEADS)], [0, 1], 4)
        ship = KVShipper(sender, pool(2, 4, KV_HEADS, fill=True), 4, HEADS, KV_HEADS, 1, 0, torch.device("cpu"))
        ship.plan([PlanEntry("gone", 0, list(range(8)), 0, [], True)], {"gone": [0, 1]}, {"gone": target})
        for layer in range(LAYERS):
            ship.after_layer(layer)
        ship.finish()
        sender.close()
        assert not notify.poll(500)  # no KVArrived for a cancelled room
        assert rc.bytes == 0 and all(not t.any() for kv in d_pool for t in kv)
    finally:
        rc.close()
        notify.close(linger=0)
