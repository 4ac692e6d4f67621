"""The engine's nouns: SamplingParams, Request and what a finished request returns."""

from __future__ import annotations

import enum
import hashlib
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardserve.structured_outputs import StructuredOutputsParams
from shardserve.text import IncrementalText

if TYPE_CHECKING:
    import torch

_MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # a temperature under this is greedy


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter to run a request with, as vLLM names it: `lora_int_id` must be unique per
    adapter (>= 1) for the engine's life; the adapter is the PEFT directory at `lora_path`."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not (_is_int(self.lora_int_id) and self.lora_int_id >= 1):
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1 (got {self.lora_int_id!r})")
        if not self.lora_name or not self.lora_path:
            raise ValueError("LoRARequest needs a lora_name and a lora_path")

    @property
    def cache_root(self) -> bytes:
        """The parent digest of a sequence's first KV page under this adapter: pages computed with
        different adapters (or none: b"") never share a prefix-cache entry."""
        return hashlib.blake2b(f"lora\0{self.lora_int_id}\0{self.lora_name}\0{self.lora_path}".encode(),
                               digest_size=16).digest()


@dataclass
class SamplingParams:
    """How to pick tokens for one prompt; the fields and meanings follow vLLM's.

    `temperature == 0` (below 1e-5) means greedy. `logprobs=None` returns none; `logprobs=k` returns the
    sampled token's log-probability and the top k (k may be 0). `prompt_logprobs=k` does the same
    for every prompt token after the first (the model's own distribution; such a request skips
    the prefix cache, since cached tokens are never scored). Penalties follow the usual
    conventions: `repetition_penalty` (Hugging Face, over prompt and output, 1 = off) and
    `presence_penalty` / `frequency_penalty` (OpenAI, over output only, 0 = off). `logit_bias`
    maps token ids to a bias in [-100, 100] added to the raw logits before the penalties, as
    vLLM does (+100 all but forces a token, -100 all but bans it); reported logprobs stay the
    model's own. `structured_outputs` (structured_outputs.py) holds the output to a JSON schema,
    regex, grammar or choice, token by token.

    vLLM's extras: `min_tokens` (no EOS, stop token or stop string before that many output
    tokens), `include_stop_str_in_output`, `allowed_token_ids` (every other token banned),
    `bad_words` (each word's last token banned where the output ends in the rest of it; the
    tokenizer's holder fills `bad_words_token_ids`, see `update_from_tokenizer`) and
    `truncate_prompt_tokens` (keep only the prompt's last N tokens, see `truncate`).

    `pooling` ("last" or "mean") makes the request an embedding: the prompt's final hidden states
    (after the model's last norm), the last token's or their mean, come back with its one output
    token (max_tokens must be 1; the token is not part of the answer). Like prompt_logprobs, such
    a request skips the prefix cache: cached tokens have no hidden states.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None  # see structured_outputs.py
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None  # set by update_from_tokenizer
    truncate_prompt_tokens: int | None = None
    pooling: str | None = None
    # The LoRA adapter to run with (set from the request's `model`, or LLM.generate's lora_request).
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        checks = [
            (_is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1"),
            (_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k", "must be -1 (off) or >= 1"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**63), "seed",
             "must be a 64-bit signed integer"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be ids >= 0"),
            (
                self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= _MAX_LOGPROBS),
                "logprobs",
                f"must be None or an integer in [0, {_MAX_LOGPROBS}]",
            ),
            (
                self.prompt_logprobs is None
                or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= _MAX_LOGPROBS),
                "prompt_logprobs",
                f"must be None or an integer in [0, {_MAX_LOGPROBS}]",
            ),
            *self._extra_checks(),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {why} (got {getattr(self, name)!r})")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"SamplingParams.logit_bias must be a dict of token id -> bias "
                                 f"(got {type(self.logit_bias).__name__})")
            for t, v in self.logit_bias.items():
                if not (_is_int(t) and t >= 0 and isinstance(v, int | float) and not isinstance(v, bool)
                        and -100 <= v <= 100):
                    raise ValueError(f"SamplingParams.logit_bias must map token ids >= 0 to biases in "
                                     f"[-100, 100] (got {t!r}: {v!r})")
            self.logit_bias = {t: float(v) for t, v in self.logit_bias.items()} or None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.lora_request, dict):
            self.lora_request = LoRARequest(**self.lora_request)
        if not isinstance(self.structured_outputs, StructuredOutputsParams | None):
            raise ValueError(f"SamplingParams.structured_outputs must be a StructuredOutputsParams "
                             f"(got {type(self.structured_outputs).__name__})")

    def _extra_checks(self) -> list[tuple[bool, str, str]]:
        ids = self.allowed_token_ids
        return [
            (_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             "must be an integer in [0, max_tokens]"),
            (ids is None or (isinstance(ids, list) and ids and all(_is_int(t) and t >= 0 for t in ids)),
             "allowed_token_ids", "must be None or a non-empty list of ids >= 0"),
            (self.bad_words is None or all(isinstance(w, str) and w.strip() for w in self.bad_words),
             "bad_words", "must be words with a non-blank character"),
            (self.truncate_prompt_tokens is None or (_is_int(self.truncate_prompt_tokens)
                                                     and self.truncate_prompt_tokens >= 1),
             "truncate_prompt_tokens", "must be None or an integer >= 1"),
            (self.pooling in (None, "last", "mean") and (self.pooling is None or self.max_tokens == 1), "pooling",
             "must be None, 'last' or 'mean' (an embedding, with max_tokens 1)"),
        ]

    def update_from_tokenizer(self, tok) -> None:
        """`bad_words` as token sequences, as vLLM makes them: each word as the text begins with
        it, and after a space where that is a different token sequence of the same length."""
        if not self.bad_words:
            return
        seqs: list[list[int]] = []
        for word in self.bad_words:
            bare = tok.encode(word.lstrip(), add_special_tokens=False)
            seqs.append(bare)
            spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
                seqs.append(spaced)
        self.bad_words_token_ids = seqs

    def truncate(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt as the engine sees it: its last `truncate_prompt_tokens` tokens."""
        k = self.truncate_prompt_tokens
        return list(prompt_token_ids[-k:]) if k is not None else list(prompt_token_ids)

    @property
    def greedy(self) -> bool:
        """Argmax: temperature 0 (below 1e-5, as vLLM: dividing by less overflows the logits to
        infinity) or top_k 1."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    def sample_seed(self, index: int) -> int | None:
        """The seed of the index-th of n samples: seed + index, wrapped to stay a 64-bit int."""
        if self.seed is None:
            return None
        return (self.seed + index + 2**63) % 2**64 - 2**63


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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

    @property
    def cache_root(self) -> bytes:
        """Where its prefix-cache digests start: keyed by its adapter, if any."""
        lora = self.params.lora_request
        return lora.cache_root if lora is not None else b""

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

    def append_token(self, token: int) -> None:
        """Add one generated token (keeps `all_token_ids` without rebuilding it every step)."""
        self.output_token_ids.append(token)
        self._tokens.append(token)

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
