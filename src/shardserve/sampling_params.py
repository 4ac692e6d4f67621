"""SamplingParams (how to pick a request's tokens, as vLLM names the fields) and LoRARequest."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from shardserve.structured_outputs import StructuredOutputsParams

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
    # Scheduling priority under --scheduling-policy priority (the request's `priority`, or
    # LLM.generate's): lower runs first, ties by arrival (vLLM's meaning). Under fcfs only 0.
    priority: int = 0

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
            (_is_int(self.priority) and -(2**63) <= self.priority < 2**63, "priority",
             "must be a 64-bit signed integer"),
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
