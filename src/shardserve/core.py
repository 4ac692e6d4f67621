"""The engine's nouns: Request, the batch a step runs and what a finished request returns (its
SamplingParams: sampling_params.py)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardserve.multimodal import ImageInput, cache_tokens
from shardserve.sampling_params import SamplingParams
from shardserve.text import IncrementalText

if TYPE_CHECKING:
    import torch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_request_counter = itertools.count()


@dataclass
class Request:
    """One sequence being generated: its tokens, its KV pages and its progress.

    `num_computed_tokens` counts tokens whose KV is in the cache (prefix hits included). A
    preempted request drops its pages and goes back to waiting with that count reset; its
    output tokens so far become part of what it must recompute.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    pages: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)  # prefix-cache digests of full pages
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict] = field(default_factory=list)
    # With params.prompt_logprobs: one entry per prompt token scored so far; the first token has
    # no context, so its entry has logprob None.
    prompt_logprobs: list[dict] = field(default_factory=list)
    generator: torch.Generator | None = None
    arrival: int = field(default_factory=lambda: next(_request_counter))
    # Set by the scheduler when a stop string matched: how many characters of text to keep.
    text_cut: int | None = None
    stop_text: IncrementalText | None = None  # with stop strings: the output's text so far
    # The leader's bookkeeping of what the other ranks know (see engine/stage_worker.py): whether
    # they have heard of this request, and how many leading pages their copy still shares.
    seed: int = 0
    announced: bool = False
    pages_synced: int = 0
    # Leader, --async-scheduling: tokens sampled by plans still in flight, not yet in the token
    # list (0 or 1 when a plan is made: the next plan's placeholder for it; see scheduler/overlap.py).
    pending: int = 0
    # On the sampling rank, with structured outputs: the request's grammar matcher (engine/grammar.py).
    matcher: Any = field(default=None, repr=False, compare=False)
    # Disaggregation. Prefill side: where the KV goes (ipc.messages.disagg.KVTarget); the request ends
    # after its first token. Decode side: the prefill sampler's random state after that token.
    transfer: Any = field(default=None, repr=False, compare=False)
    rng_state: bytes = field(default=b"", repr=False, compare=False)
    # With params.pooling. Sampling rank: the pooled hidden states so far (a float32 sum, or the
    # last row) over prompt positions [0, pooled_upto). Leader: the embedding, once complete.
    pool: Any = field(default=None, repr=False, compare=False)
    pooled_upto: int = 0
    embedding: list[float] | None = field(default=None, repr=False, compare=False)
    error: str | None = None  # why it failed alone (finish_reason "error"): a fault in its rows or its grammar
    lora_slot: int = -1  # leader, --enable-lora: the adapter slot it holds while running (-1: none)
    images: tuple[ImageInput, ...] = ()  # the prompt's images, in order (multimodal.py)

    @property
    def cache_root(self) -> bytes:
        """Where its prefix-cache digests start: keyed by its adapter, if any."""
        lora = self.params.lora_request
        return lora.cache_root if lora is not None else b""

    @property
    def cache_key(self) -> list[int]:
        """What the prefix cache keys its pages by: its tokens, but an image's by its pixels."""
        return self._key

    @property
    def computes_prompt(self) -> bool:
        """Whether every prompt token must be computed here (no prefix cache): its prompt is scored
        or pooled."""
        p = self.params
        return p.pooling is not None or (p.prompt_logprobs is not None
                                         and len(self.prompt_logprobs) < len(self.prompt_token_ids))

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [{"token_id": self.prompt_token_ids[0], "logprob": None, "top_logprobs": []}]
        self._tokens = self.prompt_token_ids + self.output_token_ids
        self._key = cache_tokens(self._tokens, self.images)  # the same list where there are no images

    def append_token(self, token: int) -> None:
        """Add one generated token (keeps `all_token_ids` without rebuilding it every step)."""
        self.output_token_ids.append(token)
        self._tokens.append(token)
        if self._key is not self._tokens:
            self._key.append(token)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens: the request's own list, read it, never change it."""
        return self._tokens

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def num_planned(self) -> int:
        """Tokens known or on their way (`pending`): how far a plan may compute."""
        return len(self._tokens) + self.pending

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class CompletionOutput:
    """One of the n samples of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[dict] | None = None
    error: str | None = None  # with finish_reason "error": why this request failed (the others went on)


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt; `.text` etc. read the first sample."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict] | None = None  # with SamplingParams.prompt_logprobs; see Request
    embedding: list[float] | None = None  # with SamplingParams.pooling: the pooled hidden states

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict] | None:
        return self.outputs[0].logprobs


@dataclass
class Batch:
    """One step's work: `(request, number of new tokens)` pairs, one-token decodes first.

    A request is sampled this step when its new tokens reach the end of its known tokens
    (the last prompt chunk, or a decode); earlier prefill chunks only fill the cache.
    """

    entries: list[tuple[Request, int]]
    num_decode: int
    # Speculative decoding: request id -> tokens proposed after its one new token (computed in the
    # same forward, verified by the sampling rank; see scheduler/speculator.py).
    drafts: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def prompt_scoring(self) -> list[tuple[Request, int, int, int]]:
        """(request, first batch row, first position, count) of the rows whose logits score the
        next prompt token, for requests with prompt_logprobs. Row of position p scores token p+1;
        positions already scored (before a preemption) are skipped."""
        out, offset = [], 0
        for req, n in self.entries:
            if req.params.prompt_logprobs is not None:
                start = req.num_computed_tokens
                p0 = max(start, len(req.prompt_logprobs) - 1)
                p1 = min(start + n, len(req.prompt_token_ids) - 1)
                if p1 > p0:
                    out.append((req, offset + p0 - start, p0, p1 - p0))
            offset += n
        return out


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's shape: `.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
