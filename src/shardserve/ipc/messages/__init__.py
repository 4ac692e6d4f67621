"""Every message between the server's processes, as typed msgspec structs with one codec.

The messages live by channel: api (a request's way through the processes), reports (stats and
counts for /metrics and the router), plan (the leader's step plans and their results), disagg
(between prefill and decode instances), lifecycle (a child's start-up and stop), replicas (a
replica's death and return) and nodes (between launchers of different machines). This module is
the codec: `Message`, every type a channel may carry, and `encode` / `decode` / `decode_or_none`.
Messages carry no process-local state, so rank 0 can later forward them unchanged to other
scheduler ranks.
"""

from __future__ import annotations

import logging

import msgspec

from shardserve.ipc.messages.api import (
    AbortReq,
    AddRequests,
    DetokenizeOut,
    DetokenizeReq,
    ErrorOut,
    GenerateReq,
    TextBatch,
    TokenBatch,
    TokenizedReq,
    TokenizeOut,
    TokenizeReq,
)
from shardserve.ipc.messages.base import Msg
from shardserve.ipc.messages.disagg import AbortPrefill, KVArrived, PeerAlive, PrefillDone, PrefillFailed, PrefillReq
from shardserve.ipc.messages.lifecycle import Failed, Ready, Shutdown
from shardserve.ipc.messages.nodes import NodeBeat, NodeFailed, NodeHello, NodeRefused, NodeStop, NodeWelcome
from shardserve.ipc.messages.plan import StageTraffic, StepPlan, StepResult, Tick, Wake
from shardserve.ipc.messages.replicas import DropStreams, ReplicaDown, ReplicaLost, ReplicaUp
from shardserve.ipc.messages.reports import CacheEvents, RankReports, ReportReq, RouterStats, Stats

Message = (
    GenerateReq | TokenizedReq | AddRequests | AbortReq | ReportReq | RankReports | TokenBatch | TextBatch
    | ErrorOut | TokenizeReq | TokenizeOut
    | DetokenizeReq | DetokenizeOut | Stats | CacheEvents | RouterStats | StepPlan | Tick | Wake | StepResult
    | StageTraffic | PrefillReq | PrefillDone | PrefillFailed | AbortPrefill | PeerAlive | KVArrived
    | Ready | Failed | Shutdown | ReplicaDown | ReplicaUp | ReplicaLost | DropStreams
    | NodeHello | NodeWelcome | NodeRefused | NodeBeat | NodeFailed | NodeStop
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Msg:
    return _decoder.decode(data)


def decode_or_none(data: bytes, where: str) -> Msg | None:
    """`decode` for channels from other processes: a malformed message is logged and dropped,
    never allowed to end the process that got it."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        logging.getLogger("shardserve.ipc").warning("dropped a malformed %d-byte message on %s: %s", len(data),
                                                    where, str(e).splitlines()[0][:200])
        return None


__all__ = ["Message", "Msg", "decode", "decode_or_none", "encode"]
