"""A prefill instance's leader (`--disaggregation-mode prefill`): prompts in from decode
instances, first tokens back.

Decode leaders connect to the bootstrap port (a ZeroMQ ROUTER, CURVE-keyed by the deployment
secret) and send `PrefillReq`: the prompt, its sampling parameters and seed, the model shape they
run, and where the KV goes (`KVTarget`). The request joins this engine like any other (the
prefix cache serves it, chunked prefill and preemption apply), except that every rank ships its
KV layer by layer as the prefill runs (engine/kv_shipper.py) and the request ends with its first
token, which goes back in `PrefillDone` with the sampler's random state, its logprobs and the
prompt logprobs.

Both sides list the rooms they hold every second (`PeerAlive`). A decode instance that falls
silent for `--disaggregation-timeout` loses its rooms here (their pages are freed); an
`AbortPrefill` (its client left) drops one at once.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from shardserve.config import EngineConfig
from shardserve.ipc.messages import decode_or_none, encode
from shardserve.ipc.messages.disagg import AbortPrefill, ModelShape, PeerAlive, PrefillDone, PrefillFailed, PrefillReq
from shardserve.ipc.secure import Gate, serve_secure
from shardserve.scheduler.engine_core import EngineCore
from shardserve.scheduler.engine_results import StepOutput

log = logging.getLogger("shardserve.disagg")
BEAT_S = 1.0


def model_shape(engine: EngineCore) -> ModelShape:
    """What both sides must share for KV pages to pass: the KV cache's own dtype, which may not
    be --dtype's (bfloat16 on the CPU keeps a float32 cache, where the C kernels load)."""
    mc = engine.model_cfg
    kv_dtype = str(engine.runner.pool.k.dtype).removeprefix("torch.")
    return ModelShape(mc.num_layers, mc.num_kv_heads, mc.kv_widths[0], kv_dtype, mc.vocab_size,
                      engine.runner.device.type)


class PrefillSide:
    def __init__(self, engine: EngineCore, cfg: EngineConfig, secret: bytes, ctx: zmq.Context):
        self.engine, self.timeout = engine, cfg.disaggregation_timeout
        self.shape = model_shape(engine)
        self.sock = ctx.socket(zmq.ROUTER)
        self.gate = Gate(ctx, secret)
        serve_secure(self.sock, secret)
        addr = f"tcp://{cfg.disaggregation_host}:{cfg.disaggregation_port}"
        self.gate.watch(self.sock, f"the prefill bootstrap ({addr})")
        self.sock.bind(addr)
        self.rooms: dict[str, bytes] = {}  # room -> the decode peer that asked
        self.heard: dict[bytes, float] = {}  # decode peer -> when it last spoke
        self.last_beat = 0.0
        log.info("prefill instance: taking prompts from decode instances on %s", addr)

    def receive(self) -> None:
        while self.sock.poll(0):
            frames = self.sock.recv_multipart(copy=False)
            peer, data = frames[0].bytes, frames[-1]
            msg = decode_or_none(data.bytes, "the prefill bootstrap")
            self.heard[peer] = time.monotonic()
            if isinstance(msg, PrefillReq):
                self._add(peer, msg, data.get("Peer-Address"))
            elif isinstance(msg, AbortPrefill):
                self._drop(msg.room)

    def _add(self, peer: bytes, req: PrefillReq, peer_host: str) -> None:
        try:
            if req.shape != self.shape:
                raise ValueError(f"the decode instance runs {_shape_text(req.shape)}, this prefill instance "
                                 f"{_shape_text(self.shape)}: KV cannot move between them")
            target = req.target if req.target.host else msgspec.structs.replace(req.target, host=peer_host)
            self.engine.add_request(req.room, req.token_ids, req.params, seed=req.seed, transfer=target)
        except Exception as e:  # whatever a request carries, refusing it must not stop the engine
            self._send(peer, PrefillFailed(room=req.room, message=str(e), status=400))
            return
        self.rooms[req.room] = peer

    def _drop(self, room: str) -> None:
        if self.rooms.pop(room, None) is not None:
            self.engine.abort(room)

    def outputs(self, outs: list[StepOutput]) -> list[StepOutput]:
        """Send the first token of each transfer request that has one; the other outputs."""
        rest = []
        for o in outs:
            if o.request.transfer is None:
                rest.append(o)
                continue
            peer = self.rooms.pop(o.request.request_id, None)
            if peer is not None:  # else dropped meanwhile (its decode instance fell silent)
                self._send(peer, self._done(o))
        return rest

    def _done(self, o: StepOutput) -> PrefillDone:
        r = o.request
        sampled = self.engine.worker.sampling[r.request_id]  # the leader samples (one stage, no context split)
        return PrefillDone(room=r.request_id, token=o.new_token_ids[0],
                           rng_state=sampled.generator.get_state().numpy().tobytes(),
                           logprobs=r.logprobs[-1] if r.logprobs else None, prompt_logprobs=r.prompt_logprobs,
                           cached_tokens=r.num_cached_tokens, ended=o.grammar_done)

    def tick(self) -> None:
        """Every second: tell each decode peer which of its rooms are still here, and drop the
        rooms of a peer silent for longer than the timeout."""
        now = time.monotonic()
        if now - self.last_beat < BEAT_S:
            return
        self.last_beat = now
        by_peer: dict[bytes, list[str]] = {}
        for room, peer in self.rooms.items():
            by_peer.setdefault(peer, []).append(room)
        for peer, rooms in by_peer.items():
            if now - self.heard.get(peer, now) > self.timeout:
                log.warning("a decode instance fell silent for %.0f s: dropping its %d request(s)", self.timeout,
                            len(rooms))
                for room in rooms:
                    self._drop(room)
            else:
                self._send(peer, PeerAlive(rooms=rooms))

    def _send(self, peer: bytes, msg) -> None:
        self.sock.send_multipart([peer, encode(msg)])


def _shape_text(s: ModelShape) -> str:
    return (f"{s.layers} layers x {s.kv_heads} KV heads x {s.head_dim} ({s.dtype}, vocab {s.vocab}, "
            f"on {s.device})")
