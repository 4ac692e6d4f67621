"""Every message between the server's processes, as typed msgspec structs with one codec.

The flow of one request: API -> tokenizer (GenerateReq), tokenizer -> scheduler
(TokenizedReq), scheduler -> detokenizer (TokenBatch), detokenizer -> API (TextBatch). Errors,
stats and tokenize/detokenize replies go straight to the API's inbox. Messages carry no
process-local state, so rank 0 can later forward them unchanged to other scheduler ranks.
"""

from __future__ import annotations

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


class TokenizedReq(Msg):
    rid: str
    token_ids: list[int]
    params: SamplingParams
    auto_max_tokens: bool = False


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


class TokenizeOut(Msg):
    rid: str
    token_ids: list[int]


class DetokenizeReq(Msg):
    rid: str
    token_ids: list[int]


class DetokenizeOut(Msg):
    rid: str
    text: str


class Stats(Msg):
    running: int
    waiting: int
    pages_used: int
    pages_total: int
    prefix_hit_rate: float
    steps: int = 0
    finished: int = 0  # requests finished (or aborted) so far
    traffic: dict = {}  # rank 0's tensor-parallel group counts, by operation
    control: dict = {}  # rank 0's control group counts (message fan-out, token agreement)


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
    | DetokenizeReq | DetokenizeOut | Stats | Ready | Failed | Shutdown
    | NodeHello | NodeWelcome | NodeRefused | NodeBeat | NodeFailed | NodeStop
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Msg:
    return _decoder.decode(data)
