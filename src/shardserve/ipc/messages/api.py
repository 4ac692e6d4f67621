"""A request's way through the server's processes, and the API's calls to the tokenizer.

The flow of one request: API -> tokenizer (GenerateReq), tokenizer -> scheduler
(TokenizedReq), scheduler -> detokenizer (TokenBatch), detokenizer -> API (TextBatch). Errors
and tokenize/detokenize replies go straight to the API's inbox.
"""

from __future__ import annotations

from shardserve.ipc.messages.base import Msg
from shardserve.multimodal import ImageInput
from shardserve.sampling_params import SamplingParams


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
    images: list[ImageInput] = []  # the prompt's images (multimodal.py)


class AddRequests(Msg):
    """Several requests the scheduler admits together, before its next step (offline batches)."""

    items: list[TokenizedReq]


class AbortReq(Msg):
    rid: str


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
    embedding: list[float] | None = None  # SamplingParams.pooling: with the last output
    error: str | None = None  # finish_reason "error": why this request failed alone


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
    embedding: list[float] | None = None
    error: str | None = None  # the request failed alone (engine, grammar or detokenizer): why


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
    chat_options: dict | None = None  # messages: the template's options (chat_messages.render_chat)


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
