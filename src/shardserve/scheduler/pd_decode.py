"""A decode instance's leader (`--disaggregation-mode decode`): each request's prompt is computed
by the prefill instance the router named, and generation goes on here.

Per request (a "room", named `<instance nonce>-<request id>` so rooms from several decode
instances never collide at one prefill instance):

1. reserve the pages the prompt fills (waiting, first come first served, while the pool is full);
2. send `PrefillReq` to the prefill leader's bootstrap address: the prompt, the sampling
   parameters and the seed drawn here (so unseeded sampling follows this engine's sequence, as
   one server's would), the model shape, and `KVTarget` (the reserved pages, this instance's
   ranks' ports and the KV heads each holds);
3. every rank's `KVReceiver` writes the frames into its pool and reports `KVArrived`; the prefill
   leader sends `PrefillDone` (first token, random state, logprobs);
4. when both are in, the request joins the engine as if swapped out right after its prefill
   (`EngineCore.admit_transferred`) and streams on from here.

A prefill instance that says nothing of a room (`PeerAlive` lists the rooms it holds, every
second) for `--disaggregation-timeout`, or refuses it, fails the request with an error; an
aborted request (client gone) is dropped at both ends. Either way the room's pages are freed and
every rank stops writing its frames before they can be handed out again.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from shardserve.config import EngineConfig
from shardserve.ipc.messages import decode_or_none, encode
from shardserve.ipc.messages.api import ErrorOut, TokenizedReq
from shardserve.ipc.messages.disagg import AbortPrefill, KVTarget, PeerAlive, PrefillDone, PrefillFailed, PrefillReq
from shardserve.ipc.secure import connect_secure
from shardserve.layers.sharding import head_shard
from shardserve.sampling_params import SamplingParams
from shardserve.scheduler.engine_core import EngineCore
from shardserve.scheduler.engine_results import StepOutput
from shardserve.scheduler.pd_prefill import BEAT_S, model_shape

log = logging.getLogger("shardserve.disagg")
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "*")


@dataclass
class Room:
    rid: str
    room: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    prefill: str  # the prefill instance's bootstrap address
    pages: list[int] = field(default_factory=list)
    heard: float = 0.0  # when the prefill instance last spoke of it
    arrived: set[int] = field(default_factory=set)  # ranks holding all of its KV
    done: PrefillDone | None = None


class DecodeSide:
    def __init__(self, engine: EngineCore, cfg: EngineConfig, secret: bytes, ctx: zmq.Context,
                 cancel: Callable[[str], None]):
        """`cancel(room)`: this rank's receiver stops writing the room's frames."""
        self.engine, self.cfg, self.secret, self.ctx, self.cancel = engine, cfg, secret, ctx, cancel
        self.timeout = cfg.disaggregation_timeout
        self.nonce = secrets.token_hex(4)
        mc, tp = engine.model_cfg, engine.runner.groups.tensor.size
        self.heads = [(s.kv_start, s.kv_end) for s in (head_shard(mc.num_heads, mc.num_kv_heads, tp, r)
                                                          for r in range(tp))]
        self.ports = [cfg.disaggregation_port + r for r in range(tp)]
        # Wildcard: the prefill instance sends to the address it sees this instance's leader at.
        self.host = "" if cfg.disaggregation_host in WILDCARD_HOSTS else cfg.disaggregation_host
        self.shape = model_shape(engine)
        self.waiting: deque[Room] = deque()  # no pages yet
        self.rooms: dict[str, Room] = {}  # by request id: pages reserved, prefill asked
        self.by_room: dict[str, Room] = {}
        self.peers: dict[str, zmq.Socket] = {}  # bootstrap address -> DEALER
        self.errors: list[ErrorOut] = []
        self.last_beat = 0.0
        self.received = 0  # requests whose KV arrived
        log.info("decode instance: KV arrives on ports %s", ", ".join(map(str, self.ports)))

    def sockets(self) -> list[zmq.Socket]:
        return list(self.peers.values())

    def pages_reserved(self) -> int:
        return sum(len(r.pages) for r in self.rooms.values())

    def add(self, msg: TokenizedReq) -> None:
        """Queue a request for its prefill instance; raises ValueError when it cannot run here."""
        if not msg.prefill:
            raise ValueError("this decode instance needs a prefill instance for every request: send requests "
                             "through `shardserve router --prefill URL --decode URL`")
        if msg.rid in self.engine.requests or msg.rid in self.rooms:
            raise ValueError(f"request id {msg.rid!r} is already in use")
        self.engine.check_request(msg.token_ids, msg.params, tuple(msg.images))  # images: refused here
        seed = self.engine.resolve_seed(msg.params)
        self.waiting.append(Room(msg.rid, f"{self.nonce}-{msg.rid}", list(msg.token_ids), msg.params, seed,
                                 msg.prefill))

    def abort(self, rid: str) -> bool:
        """Drop a request that has not joined the engine yet (at both ends); False if unknown here."""
        for room in self.waiting:
            if room.rid == rid:
                self.waiting.remove(room)
                return True
        room = self.rooms.get(rid)
        if room is None:
            return False
        self._send(room.prefill, AbortPrefill(room=room.room))
        self._drop(room)
        return True

    def arrived(self, room_id: str, rank: int) -> None:
        room = self.by_room.get(room_id)
        if room is not None:
            room.arrived.add(rank)

    def step(self) -> list[StepOutput]:
        """Take the prefill instances' news, ask for new prompts, admit those complete; time out."""
        for sock in list(self.peers.values()):
            while sock.poll(0):
                msg = decode_or_none(sock.recv(), "a prefill instance's channel")
                self._heard(msg)
        self._reserve()
        outs = [self._admit(r) for r in list(self.rooms.values()) if r.done and len(r.arrived) == len(self.ports)]
        self._beat()
        return outs

    def _heard(self, msg) -> None:
        now = time.monotonic()
        if isinstance(msg, PeerAlive):
            for room_id in msg.rooms:
                if (room := self.by_room.get(room_id)) is not None:
                    room.heard = now
        elif isinstance(msg, PrefillDone) and (room := self.by_room.get(msg.room)) is not None:
            room.done, room.heard = msg, now
        elif isinstance(msg, PrefillFailed) and (room := self.by_room.get(msg.room)) is not None:
            self._fail(room, f"the prefill instance refused the request: {msg.message}", msg.status)

    def _reserve(self) -> None:
        alloc = self.engine.allocator
        while self.waiting:
            room = self.waiting[0]
            pages = alloc.allocate(-(-len(room.prompt) // alloc.page_size))
            if pages is None:
                return  # the pool is full: wait for running requests to free pages
            self.waiting.popleft()
            room.pages, room.heard = pages, time.monotonic()
            self.rooms[room.rid] = self.by_room[room.room] = room
            target = KVTarget(room.room, self.host, self.ports, self.heads, pages, alloc.page_size)
            try:
                self._send(room.prefill, PrefillReq(room=room.room, token_ids=room.prompt, params=room.params,
                                                    seed=room.seed, shape=self.shape, target=target))
            except zmq.ZMQError as e:  # an address ZeroMQ cannot use: this request fails, not the engine
                self._fail(room, f"cannot reach the prefill instance {room.prefill}: {e}", 400)

    def _admit(self, room: Room) -> StepOutput:
        self._forget(room)
        self.received += 1
        d = room.done
        return self.engine.admit_transferred(room.rid, room.prompt, room.params, room.seed, room.pages, d.token,
                                             d.rng_state, d.logprobs, d.prompt_logprobs, d.cached_tokens, d.ended)

    def _beat(self) -> None:
        now = time.monotonic()
        if now - self.last_beat < BEAT_S:
            return
        self.last_beat = now
        by_peer: dict[str, list[str]] = {}
        for room in list(self.rooms.values()):
            if now - room.heard > self.timeout:
                self._fail(room, f"the prefill instance {room.prefill} said nothing of the request for "
                                 f"{self.timeout:.0f} s (--disaggregation-timeout)", 503)
                self._send(room.prefill, AbortPrefill(room=room.room))
            elif room.done is None:
                by_peer.setdefault(room.prefill, []).append(room.room)
        for peer, rooms in by_peer.items():
            self._send(peer, PeerAlive(rooms=rooms))

    def _fail(self, room: Room, message: str, status: int) -> None:
        log.warning("request %s: %s", room.rid, message)
        self.errors.append(ErrorOut(rid=room.rid, message=message, status=status))
        self._drop(room)

    def _drop(self, room: Room) -> None:
        """Free the room's pages once no rank can write them any more."""
        self._forget(room)
        self.cancel(room.room)
        self.engine.drop_room(room.room)
        self.engine.allocator.release(room.pages)

    def _forget(self, room: Room) -> None:
        self.rooms.pop(room.rid, None)
        self.by_room.pop(room.room, None)

    def _send(self, addr: str, msg) -> None:
        sock = self.peers.get(addr)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            connect_secure(sock, self.secret)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(addr)
            except zmq.ZMQError:
                sock.close()
                raise
            self.peers[addr] = sock
        sock.send(encode(msg))

    def take_errors(self) -> list[ErrorOut]:
        errors, self.errors = self.errors, []
        return errors


def make_receiver(cfg: EngineConfig, runner, notify_addr: str, secret: bytes):
    """This decode rank's KV receiver, listening on the disaggregation port + its tensor rank."""
    from shardserve.kvcache.transfer import KVReceiver

    mc, tp = runner.model_cfg, runner.groups.tensor
    shard = head_shard(mc.num_heads, mc.num_kv_heads, tp.size, tp.rank)
    addr = f"tcp://{cfg.disaggregation_host}:{cfg.disaggregation_port + tp.rank}"
    return KVReceiver(runner.kv_views, cfg.page_size, shard.kv_start, addr, secret, notify_addr, tp.rank)
