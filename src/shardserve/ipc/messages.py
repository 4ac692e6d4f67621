"""Every message between the server's processes, as typed msgspec structs with one codec.

The flow of one request: API -> tokenizer (GenerateReq), tokenizer -> scheduler
(TokenizedReq), scheduler -> detokenizer (TokenBatch), detokenizer -> API (TextBatch). Errors,
stats and tokenize/detokenize replies go straight to the API's inbox. Messages carry no
process-local state, so rank 0 can later forward them unchanged to other scheduler ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TypeVar

import msgspec

from shardserve.core import SamplingParams


class Msg(msgspec.Struct, tag=True, kw_only=True):
    """Base: the class name is the wire tag."""


class GenerateReq(Msg):
    rid: str
    params: SamplingParams
    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict] | None = None  # chat: rendered through the chat template
    add_special_tokens: bool = True
    auto_max_tokens: bool = False  # max_tokens = whatever context the prompt leaves
    tools: list[dict] | None = None  # chat: tool definitions for the template
    prefill: str = ""  # disaggregated decode: the prefill instance's bootstrap address (tcp://host:port)
    chat_options: dict | None = None  # chat: the template's options (chat_messages.render_chat)


class TokenizedReq(Msg):
    rid: str
    token_ids: list[int]
    params: SamplingParams
    auto_max_tokens: bool = False
    prefill: str = ""  # see GenerateReq


class AddRequests(Msg):
    """Several requests the scheduler admits together, before its next step (offline batches)."""

    items: list[TokenizedReq]


class AbortReq(Msg):
    rid: str


class ReportReq(Msg):
    """Ask every rank for its collective counts; rank 0 answers with RankReports."""

    rid: str


class RankReports(Msg):
    rid: str
    reports: list[dict]  # by global rank: {"rank": r, "groups": {kind: {op: {"calls", "MB"}}}}


class TokenOut(Msg):
    """One request's progress in one step; `text_cut` / `hold` serve stop strings."""

    rid: str
    new_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text_cut: int | None = None
    hold: int = 0  # characters to withhold while streaming: a stop string may be forming
    skip_special_tokens: bool = True
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict] | None = None  # with the first token, when the request asked
    prompt_tokens: int = 0
    cached_tokens: int = 0


class TokenBatch(Msg):
    items: list[TokenOut]


class TextOut(Msg):
    rid: str
    text: str  # the new text since the last TextOut
    new_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class TextBatch(Msg):
    items: list[TextOut]


class ErrorOut(Msg):
    """A request that failed before or while running; `status` is the HTTP status to answer."""

    rid: str
    message: str
    status: int = 400
    param: str | None = None


class TokenizeReq(Msg):
    rid: str
    text: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    tools: list[dict] | None = None


class TokenizeOut(Msg):
    rid: str
    token_ids: list[int]


class DetokenizeReq(Msg):
    rid: str
    token_ids: list[int]
    skip_special_tokens: bool = False  # /detokenize shows them; a completion's echo does not


class DetokenizeOut(Msg):
    rid: str
    text: str


class Stats(Msg):
    running: int
    waiting: int
    pages_used: int
    pages_total: int
    prefix_hit_rate: float
    prefix_hit_tokens: int = 0  # prompt tokens served from the cache so far
    prefix_query_tokens: int = 0  # prompt tokens looked up so far
    steps: int = 0
    finished: int = 0  # requests finished (or aborted) so far
    traffic: dict = {}  # rank 0's tensor-parallel group counts, by operation
    control: dict = {}  # rank 0's control group counts (step plans, results)
    max_in_flight: int = 0  # the most micro-batches in flight at once so far
    preemptions: int = 0
    stages: dict = {}  # pipeline stage -> that stage's tensor rank 0's counts by group (StageTraffic.groups)
    replica: int = 0  # which data-parallel replica's leader sent it
    empty_steps: int = 0  # data-parallel attention: steps run with no tokens, to join the other replicas
    # MoE routing counts of the leader's layers (the first pipeline stage's): layer -> pairs per expert
    expert_routed: dict[str, list[int]] = {}
    # Disaggregation: KV shipped (prefill side) or received (decode side), see kvcache/transfer.py
    transfer: dict = {}


_SUMMED = ("running", "waiting", "pages_used", "pages_total", "steps", "finished", "preemptions",
           "prefix_hit_tokens", "prefix_query_tokens", "empty_steps")


def merge_stats(reps: list[Stats]) -> Stats:
    """Several replicas' stats as one: counts (routing counts too) summed, the hit rate over all
    their prompt tokens; traffic and pipeline stages are replica 0's (rank 0's, as with one
    replica)."""
    if len(reps) == 1:
        return reps[0]
    queries = sum(s.prefix_query_tokens for s in reps)
    first = min(reps, key=lambda s: s.replica)
    return Stats(**{f: sum(getattr(s, f) for s in reps) for f in _SUMMED},
                 prefix_hit_rate=sum(s.prefix_hit_tokens for s in reps) / queries if queries else 0.0,
                 max_in_flight=max(s.max_in_flight for s in reps), traffic=first.traffic, control=first.control,
                 stages=first.stages, expert_routed=sum_counts([s.expert_routed for s in reps]))


K = TypeVar("K")


def sum_counts(parts: Iterable[Mapping[K, list[int]]]) -> dict[K, list[int]]:
    """Per-layer routing counts (layer -> count per expert) added up layer by layer, keys as given."""
    total: dict[K, list[int]] = {}
    for counts in parts:
        for layer, row in counts.items():
            acc = total.get(layer, [0] * len(row))
            total[layer] = [a + c for a, c in zip(acc, row)]
    return total


class CacheEvents(Msg):
    """A replica leader's news for the router (dp > 1): page digests that joined or left its prefix
    cache and requests that ended (finished, aborted or refused), in the order they happened.
    `seq` counts messages per replica, so the router notices one it missed."""

    replica: int
    seq: int
    stored: list[bytes] = []
    evicted: list[bytes] = []
    ended: list[str] = []


class RouterStats(Msg):
    """The in-server router's per-replica counts, for /metrics."""

    routed: list[int]
    prompt_tokens: list[int]
    in_flight: list[int]
    load_tokens: list[int]


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


# The leader's step plans, fanned out to every other rank of the replica (engine/stage_worker.py).
class PlanRequest(msgspec.Struct, array_like=True):
    """A request the other ranks hear of the first time it is scheduled."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    seed: int  # resolved by the leader, so whichever rank samples draws the same tokens
    # With structured outputs or min_tokens: the leader's EOS ids (allowed only once the grammar
    # is complete, banned before min_tokens).
    eos: list[int] = []
    # Disaggregated prefill: where this request's KV goes, layer by layer (kvcache/transfer.py).
    transfer: KVTarget | None = None
    # Disaggregated decode: the tokens the prefill instance sampled, and its sampler's random
    # state after them, so this instance continues exactly as one engine would.
    output: list[int] = []
    rng_state: bytes = b""


class PlanEntry(msgspec.Struct, array_like=True):
    """One request's share of a micro-batch: tokens [start, start + n) of its sequence."""

    rid: str
    start: int
    token_ids: list[int]  # the n tokens (only the first stage embeds them)
    page_base: int  # the request's page list becomes pages[:page_base] + new_pages
    new_pages: list[int]
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    score_first: int = -1  # prompt logprobs: first position scored in this chunk (-1: none)
    score_count: int = 0


class StepPlan(Msg):
    """One micro-batch: every rank of the replica runs exactly these, in `mb` order."""

    mb: int
    entries: list[PlanEntry]
    new: list[PlanRequest] = []
    done: list[str] = []  # requests finished or aborted since the last plan: forget them
    dropped: list[str] = []  # disaggregated decode: transfer rooms given up: write no more of their KV


class Tick(Msg):
    """The leader is alive but idle (the other ranks' wait for plans stays bounded)."""


class Wake(Msg):
    """Data-parallel attention: the router sent some replica work; every leader, idle or not,
    must join the next step (numbered, so a leader can tell a wake it has already acted on)."""

    seq: int


class StepResult(Msg):
    """What the sampling rank (last stage, tensor rank 0) returns for micro-batch `mb`."""

    mb: int
    tokens: list[int]  # one per sampled entry, in plan order
    logprobs: list[dict | None] = []
    prompt_logprobs: list[list[dict]] = []  # one list per scoring entry, in plan order
    ended: list[int] = []  # structured outputs: sampled entries (by position) whose output is complete


class StageTraffic(Msg):
    """A later stage's counts, for /metrics: {kind: {op: {calls, MB}}}."""

    stage: int
    rank: int
    groups: dict


class Ready(Msg):
    name: str
    info: dict = {}


class Failed(Msg):
    name: str
    error: str


class Shutdown(Msg):
    pass


# Between launchers of different machines (launch/nodes.py).
class NodeHello(Msg):
    node_rank: int
    nnodes: int
    world: int
    layout: str
    model: str


class NodeWelcome(Msg):
    pass


class NodeRefused(Msg):
    reason: str


class NodeBeat(Msg):
    pass


class NodeFailed(Msg):
    reason: str


class NodeStop(Msg):
    pass


Message = (
    GenerateReq | TokenizedReq | AddRequests | AbortReq | ReportReq | RankReports | TokenBatch | TextBatch
    | ErrorOut | TokenizeReq | TokenizeOut
    | DetokenizeReq | DetokenizeOut | Stats | CacheEvents | RouterStats | StepPlan | Tick | Wake | StepResult
    | StageTraffic | PrefillReq | PrefillDone | PrefillFailed | AbortPrefill | PeerAlive | KVArrived
    | Ready | Failed | Shutdown
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
