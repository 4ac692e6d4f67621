"""Disaggregation: what a decode instance's and a prefill instance's leaders (and ranks) tell
each other (scheduler/pd_prefill.py, scheduler/pd_decode.py, kvcache/transfer.py)."""

from __future__ import annotations

import msgspec

from shardserve.ipc.messages.base import Msg
from shardserve.sampling_params import SamplingParams


class KVTarget(msgspec.Struct, array_like=True):
    """Disaggregation: where a prefill's KV goes. The decode instance's ranks listen at `host` on
    `ports` (one per tensor rank), rank i holding KV heads [heads[i][0], heads[i][1]); `pages` are
    the decode instance's pages reserved for the prompt, `page_size` its page size."""

    room: str
    host: str
    ports: list[int]
    heads: list[tuple[int, int]]
    pages: list[int]
    page_size: int


class ModelShape(msgspec.Struct, array_like=True):
    """What must match for KV to move between two instances."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    vocab: int
    device: str  # the sampler's random state is device-specific


class PrefillReq(Msg):
    """Decode leader -> prefill leader: compute this prompt, sample its first token, ship the KV."""

    room: str
    token_ids: list[int]
    params: SamplingParams
    seed: int
    shape: ModelShape
    target: KVTarget


class PrefillDone(Msg):
    """Prefill leader -> decode leader: the first token and all the decode side needs to go on."""

    room: str
    token: int
    rng_state: bytes
    logprobs: dict | None = None
    prompt_logprobs: list[dict] = []
    cached_tokens: int = 0
    ended: bool = False  # structured outputs: the grammar is complete after this token


class PrefillFailed(Msg):
    room: str
    message: str
    status: int = 500


class AbortPrefill(Msg):
    """Decode leader -> prefill leader: the request is gone (client left, timed out)."""

    room: str


class PeerAlive(Msg):
    """Both directions, every second while rooms are open between two instances: which of them
    the sender still holds (a room not listed for `--disaggregation-timeout` is dropped)."""

    rooms: list[str]


class KVArrived(Msg):
    """A decode rank's receiver -> its leader: every KV frame of `room` is in this rank's pool."""

    room: str
    rank: int
