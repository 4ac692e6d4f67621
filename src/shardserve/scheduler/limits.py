"""What a request must fit, checked by the engine and, earlier, by any process that knows them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardserve.config import EngineConfig
from shardserve.multimodal import ImageInput, check_images
from shardserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit; also sent to other processes so they can refuse early."""

    vocab_size: int
    max_model_len: int
    num_pages: int  # in all: under context parallelism, `parts` equal pools
    page_size: int
    has_tokenizer: bool
    parts: int = 1
    hidden_size: int = 0  # an embedding's width
    by_priority: bool = False  # --scheduling-policy priority; else only priority 0 is taken
    # Images (multimodal.py): the placeholder token, tokens and pixels per image where this engine
    # takes them; else why not (one line for the 400).
    image_token: int = -1
    image_tokens: int = 0
    image_size: int = 0
    images_refused: str = "this model reads text only"

    def check(self, prompt_token_ids: list[int], params: SamplingParams, images: Sequence[ImageInput] = ()) -> None:
        """Raise ValueError if the request can never run; nothing is truncated silently."""
        if images and self.images_refused:
            raise ValueError(f"images: {self.images_refused}")
        if images or self.image_token >= 0:
            check_images(images, prompt_token_ids, self.image_token, self.image_tokens, self.image_size)
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.max_model_len} tokens"
            )
        pages = -(-(n + params.max_tokens) // self.page_size)
        if self.parts > 1 and -(-pages // self.parts) > self.num_pages // self.parts:
            # kvcache/spread.py keeps a request within a page of even over the pools.
            raise ValueError(f"request needs {pages} KV pages, {-(-pages // self.parts)} in each of the "
                             f"{self.parts} context-parallel ranks' pools, which hold {self.num_pages // self.parts}")
        if pages > self.num_pages:
            raise ValueError(f"request needs {pages} KV pages but the pool holds {self.num_pages}")
        if params.pooling is not None and self.parts > 1:
            raise ValueError("embeddings are not supported under context parallelism (the prompt's rows lie on "
                             "several ranks): serve them with --cp-size 1")
        if params.priority and not self.by_priority:
            raise ValueError(f"priority {params.priority} needs --scheduling-policy priority (LLM(scheduling_policy="
                             "'priority')); this engine schedules first come, first served")
        if params.stop and not self.has_tokenizer:
            raise ValueError("stop strings need a tokenizer")
        if params.structured_outputs is not None and not self.has_tokenizer:
            raise ValueError("structured outputs need a tokenizer")


def images_refused(cfg: EngineConfig, backend: str, image_tokens: int) -> str:
    """Why this engine cannot take a vision-language model's images ("" where it can): each
    image's tokens attend to each other both ways (multimodal.py), which the CPU and torch
    attention backends describe, and arrive in one prefill chunk."""
    v = cfg.speculative_config
    why = [(backend == "context", "context parallelism (--cp-size) does not attend over images"),
           (backend not in ("cpu", "torch", "context"), f"the {backend} attention backend does not attend over "
                                                        "images (--attention-backend cpu or torch does)"),
           (cfg.max_num_batched_tokens < image_tokens, f"--max-num-batched-tokens {cfg.max_num_batched_tokens} "
                                                       f"cannot hold an image's {image_tokens} tokens in one step"),
           (cfg.disaggregation_mode != "null", "disaggregated serving (--disaggregation-mode) does not carry images"),
           (v is not None and v.method == "draft", "a draft model (--speculative-method draft) reads text only")]
    return next((w for bad, w in why if bad), "")
