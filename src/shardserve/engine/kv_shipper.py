"""A prefill instance's rank shipping its share of each transfer request's KV, layer by layer.

For every plan entry of a request bound for a decode instance (`PlanRequest.transfer`), this
rank sends, right after each layer of the forward, the K/V of the positions the decode side does
not have yet (the chunk's tokens, and at the first chunk any prefix-cache hit before them) for
the KV heads it is the sender of (kvcache/transfer.py's rule), to each decode rank that holds
them. After the request's last chunk every decode rank gets this rank's end marker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shardserve.ipc.messages.disagg import KVTarget
from shardserve.ipc.messages.plan import PlanEntry
from shardserve.kvcache.transfer import KVSender, frame_header, sender_heads, slots, target_pages
from shardserve.layers.sharding import head_shard


@dataclass
class Shipment:
    """One request's chunk this step: positions [start, start + count) from `src` slots here."""

    target: KVTarget
    src: torch.Tensor
    start: int
    count: int
    sends: list[tuple[str, int, int]]  # (decode rank's address, first head, end head)
    last: bool  # the prompt's last chunk: end markers follow


class KVShipper:
    def __init__(self, sender: KVSender, kv_views: list, page_size: int, num_heads: int, num_kv_heads: int,
                 tp_size: int, tp_rank: int, device: torch.device):
        self.sender, self.kv_views, self.page_size, self.device = sender, kv_views, page_size, device
        self.kv_heads, self.tp, self.rank = num_kv_heads, tp_size, tp_rank
        shards = [head_shard(num_heads, num_kv_heads, tp_size, r) for r in range(tp_size)]
        self.ranges = [(s.kv_start, s.kv_end) for s in shards]
        self.kv0 = self.ranges[tp_rank][0]
        self.sent_upto: dict[str, int] = {}  # room -> positions the decode side has been sent
        self.current: list[Shipment] = []
        self.computed_at = 0.0

    def forget(self, room: str) -> None:
        self.sent_upto.pop(room, None)

    def plan(self, entries: list[PlanEntry], pages: dict[str, list[int]], targets: dict[str, KVTarget]) -> bool:
        """Shipments of this step's transfer entries; whether there are any."""
        self.current = []
        for e in entries:
            target = targets.get(e.rid)
            if target is None:
                continue
            start, end = self.sent_upto.get(e.rid, 0), e.start + len(e.token_ids)
            if end <= start:
                continue
            self.sent_upto[e.rid] = end
            src = slots(pages[e.rid], self.page_size, start, end - start).to(self.device)
            sends = []
            for port, want in zip(target.ports, target.heads):
                h0, h1 = sender_heads(self.kv_heads, self.ranges, self.rank, tuple(want))
                if h1 > h0:
                    sends.append((f"tcp://{target.host}:{port}", h0, h1))
            self.current.append(Shipment(target, src, start, end - start, sends, e.sample))
        return bool(self.current)

    def after_layer(self, layer: int) -> None:
        """Called once layer `layer` has run: its pages of this step's chunks leave now."""
        if layer == len(self.kv_views) - 1:
            self.computed_at = time.monotonic()  # the prefill's compute of these chunks is done
        k_cache, v_cache = self.kv_views[layer]
        for sh in self.current:
            k, v = k_cache.index_select(0, sh.src), v_cache.index_select(0, sh.src)
            pages = target_pages(sh.target, sh.start, sh.count)
            for addr, h0, h1 in sh.sends:
                local = slice(h0 - self.kv0, h1 - self.kv0)
                head = frame_header(sh.target.room, layer=layer, start=sh.start, count=sh.count, h0=h0, h1=h1,
                                    pages=pages)
                self.sender.send(addr, sh.target.room, [head, _raw(k[:, local]), _raw(v[:, local])], layer)

    def finish(self) -> None:
        """After the forward: end markers for requests whose prompt is complete."""
        for sh in self.current:
            if sh.last:
                room = sh.target.room
                for port in sh.target.ports:
                    addr = f"tcp://{sh.target.host}:{port}"
                    self.sender.send(addr, room, [frame_header(room, end=True, senders=self.tp)])
                self.forget(room)
            self.sender.chunk_done(sh.target.room, self.computed_at, sh.last)
        self.current = []


def _raw(t: torch.Tensor):
    """The tensor's bytes as a buffer ZeroMQ sends without copying (CPU memory)."""
    t = t.contiguous()
    return t.view(torch.uint8).cpu().numpy() if t.dtype != torch.uint8 else t.cpu().numpy()
