"""KV moving between instances (disaggregated prefill/decode), layer by layer, as raw bytes.

Every rank of the prefill instance that holds KV heads some decode rank needs sends them to
that rank over its own ZeroMQ PUSH -> PULL TCP channel (CURVE, keyed by the deployment secret):

    [header, K bytes, V bytes]   per chunk, per layer: as soon as the prefill computed the layer
    [header]                     the room's end marker, once its last chunk is computed

A header (`KVFrame`, msgpack) says which room, layer, token positions and global KV heads the
bytes hold and the decode pages those positions go to; the bytes are the pool's own memory,
[tokens, heads, head_dim] in the pool's dtype, never pickled. A head replicated over several
prefill ranks (tensor parallelism) is sent by the lowest of them only, and each decode rank
receives exactly the heads its own query heads read: KV heads are re-split on arrival, so the
two instances may run different `--tp-size`.

`KVSender` (prefill ranks) sends from a thread, so the frames of layer l travel while layer l+1
computes. `KVReceiver` (decode ranks) writes frames into the pool from a thread, and tells its
leader (`KVArrived`) once every prefill rank's end marker is in. Writes land in pages reserved
for the room; a room its leader dropped (`cancel`) takes no more writes, so a late frame can
never touch pages given to another request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from shardserve.ipc.messages import encode
from shardserve.ipc.messages.disagg import KVArrived, KVTarget
from shardserve.ipc.secure import Gate, connect_secure, serve_secure

log = logging.getLogger("shardserve.transfer")
POLL_MS = 100  # the threads look at their stop flag this often


class KVFrame(msgspec.Struct, array_like=True):
    """Positions [start, start + count) of one room, KV heads [h0, h1) of one layer (`end`: the
    room's end marker from one of `senders` prefill ranks). `pages` are the decode pages holding
    those positions, from the one holding `start`."""

    room: str
    layer: int = 0
    start: int = 0
    count: int = 0
    h0: int = 0
    h1: int = 0
    pages: list[int] = []
    end: bool = False
    senders: int = 1


_encode_frame = msgspec.msgpack.Encoder().encode
_decode_frame = msgspec.msgpack.Decoder(KVFrame).decode


def slots(pages: list[int], page_size: int, start: int, count: int, first_page: int = 0) -> torch.Tensor:
    """Pool slots of positions [start, start + count), `pages[0]` being page `first_page` of the
    sequence."""
    pos = torch.arange(start, start + count)
    table = torch.tensor(pages, dtype=torch.long)
    return table[pos // page_size - first_page] * page_size + pos % page_size


def sender_heads(kv_heads: int, ranges: list[tuple[int, int]], mine: int, want: tuple[int, int]) -> tuple[int, int]:
    """Of the KV heads `want` (a decode rank's), those prefill rank `mine` sends: each head comes
    from the lowest prefill rank holding it (`ranges`: every prefill rank's [start, end))."""
    owner = [min(r for r, (a, b) in enumerate(ranges) if a <= h < b) for h in range(kv_heads)]
    heads = [h for h in range(*want) if owner[h] == mine]
    return (heads[0], heads[-1] + 1) if heads else (0, 0)


@dataclass
class TransferStats:
    """The prefill side's record (rank 0's heads): what went out, and how much of it left while
    the prefill was still computing."""

    requests: int = 0
    bytes: int = 0
    early_bytes: int = 0  # handed to the socket before the chunk's last layer was computed
    chunks: int = 0
    early_chunks: int = 0  # chunks whose layer 0 left before their last layer was computed
    exposed_s: float = 0.0  # from a room's last layer computed to its last byte handed over
    failed: int = 0

    def report(self) -> dict:
        return dict(vars(self))


@dataclass
class _Room:
    sends: list[tuple[float, int]] = field(default_factory=list)  # (when, bytes) of this chunk
    layer0_at: float | None = None
    failed: bool = False


class KVSender:
    """A prefill rank's outgoing frames, sent in order by one thread."""

    def __init__(self, secret: bytes, timeout_s: float):
        self.secret, self.timeout_ms = secret, int(timeout_s * 1000)
        self.queue: queue.Queue = queue.Queue()
        self.stats = TransferStats()
        self._rooms: dict[str, _Room] = {}
        self._dead: dict[str, float] = {}  # address -> when a send to it timed out
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    def send(self, addr: str, room: str, frames: list, layer: int = -1) -> None:
        self.queue.put(("send", addr, room, frames, layer, time.monotonic()))

    def chunk_done(self, room: str, computed_at: float, last: bool) -> None:
        """Every frame of the room's chunk is queued; its last layer was computed at `computed_at`."""
        self.queue.put(("chunk", room, computed_at, last))

    def close(self) -> None:
        self.queue.put(None)
        self._thread.join(timeout=2)

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        socks: dict[str, zmq.Socket] = {}
        while (item := self.queue.get()) is not None:
            if item[0] == "chunk":
                self._chunk(*item[1:])
                continue
            _, addr, room, frames, layer, queued = item
            rec = self._rooms.setdefault(room, _Room())
            if rec.failed or self._dead.get(addr, -1.0) > queued:
                rec.failed = True
                continue
            sock = socks.get(addr) or socks.setdefault(addr, self._connect(ctx, addr))
            try:
                sock.send_multipart(frames, copy=False)
            except zmq.Again:
                log.warning("KV for %s: %s took nothing for %.0f s; dropping the room", room, addr,
                            self.timeout_ms / 1000)
                rec.failed, self._dead[addr] = True, time.monotonic()
                socks.pop(addr).close(linger=0)
                continue
            now, size = time.monotonic(), sum(memoryview(f).nbytes for f in frames[1:])
            rec.sends.append((now, size))
            if layer == 0 and rec.layer0_at is None:
                rec.layer0_at = now
        for sock in socks.values():
            sock.close(linger=self.timeout_ms)

    def _connect(self, ctx: zmq.Context, addr: str) -> zmq.Socket:
        sock = ctx.socket(zmq.PUSH)
        connect_secure(sock, self.secret)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a live connection: a dead peer times out
        sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        sock.connect(addr)
        return sock

    def _chunk(self, room: str, computed_at: float, last: bool) -> None:
        rec = self._rooms.pop(room, _Room()) if last else self._rooms.setdefault(room, _Room())
        s = self.stats
        s.chunks += 1
        s.early_chunks += rec.layer0_at is not None and rec.layer0_at <= computed_at
        s.bytes += sum(b for _, b in rec.sends)
        s.early_bytes += sum(b for t, b in rec.sends if t <= computed_at)
        if last:
            s.requests += 1
            s.failed += rec.failed
            if rec.sends:
                s.exposed_s += max(0.0, rec.sends[-1][0] - computed_at)
        else:
            rec.sends, rec.layer0_at = [], None


def frame_header(room: str, **kw) -> bytes:
    return _encode_frame(KVFrame(room, **kw))


class KVReceiver:
    """A decode rank's incoming frames, written into its KV pool by one thread."""

    def __init__(self, kv_views: list, page_size: int, kv_start: int, addr: str, secret: bytes,
                 notify_addr: str, rank: int, ctx: zmq.Context | None = None):
        """`kv_views`: per layer (K, V) of [slots, local KV heads, head_dim]; `kv_start`: the global
        index of this rank's first KV head; `notify_addr`: the leader's inbox."""
        self.kv_views, self.page_size, self.kv_start, self.rank = kv_views, page_size, kv_start, rank
        self.lock = threading.Lock()
        self.ends: dict[str, int] = {}  # room -> end markers seen
        self.cancelled: set[str] = set()
        self._order: deque[str] = deque()  # cancelled rooms, oldest first (the set stays bounded)
        self.bytes = 0
        ctx = ctx or zmq.Context.instance()
        self.pull = ctx.socket(zmq.PULL)
        self.gate = Gate(ctx, secret)
        serve_secure(self.pull, secret)
        self.gate.watch(self.pull, f"the KV receiver ({addr})")
        self.pull.bind(addr)
        self.notify = ctx.socket(zmq.PUSH)
        self.notify.connect(notify_addr)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kv-receiver", daemon=True)
        self._thread.start()

    def cancel(self, room: str) -> None:
        """The leader dropped `room`: no frame of it is written after this returns."""
        with self.lock:
            self.ends.pop(room, None)
            self.cancelled.add(room)
            self._order.append(room)
            if len(self._order) > 10000:
                self.cancelled.discard(self._order.popleft())

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop:
            if not self.pull.poll(POLL_MS):
                continue
            frames = self.pull.recv_multipart(copy=False)
            try:
                head = _decode_frame(frames[0].buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("rank %d: dropped a malformed KV frame: %s", self.rank, e)
                continue
            done = False
            with self.lock:
                if head.room in self.cancelled:
                    continue
                if head.end:
                    self.ends[head.room] = self.ends.get(head.room, 0) + 1
                    done = self.ends[head.room] >= head.senders
                    if done:
                        del self.ends[head.room]
                elif len(frames) == 3:
                    self._write(head, frames[1].buffer, frames[2].buffer)
            if done:
                self.notify.send(encode(KVArrived(room=head.room, rank=self.rank)))

    def _write(self, h: KVFrame, kb, vb) -> None:
        where = slots(h.pages, self.page_size, h.start, h.count, h.start // self.page_size)
        local = slice(h.h0 - self.kv_start, h.h1 - self.kv_start)
        for cache, data in zip(self.kv_views[h.layer], (kb, vb)):
            if cache.shape[-1] == 0:  # latent attention's V: zero wide, nothing travels
                continue
            rows = torch.frombuffer(data, dtype=cache.dtype).view(h.count, h.h1 - h.h0, cache.shape[-1])
            cache[where.to(cache.device), local] = rows.to(cache.device)
        self.bytes += len(kb) + len(vb)


def target_pages(target: KVTarget, start: int, count: int) -> list[int]:
    """The decode pages holding positions [start, start + count)."""
    ps = target.page_size
    return target.pages[start // ps : (start + count - 1) // ps + 1]
