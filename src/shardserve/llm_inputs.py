"""The offline API's arguments as `LLM.generate` takes them, normalized into one entry per prompt:
a prompt is text or token ids, alone or in a list; SamplingParams and LoRA adapters come one for
every prompt or one each."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from shardserve.multimodal import ImageInput
from shardserve.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A prompt already tokenized, with its images placed (LLM.chat's)."""

    token_ids: list[int]
    images: tuple[ImageInput, ...] = ()
    text: str | None = None


# Text, token ids, vLLM's dict ({"prompt": text} or {"prompt_token_ids": ids}, with
# "multi_modal_data": {"image": a PIL image or a list of them}), or Encoded.
Prompt = str | list[int] | dict | Encoded
PROMPT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data"}


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """The prompts as a list: one string, list of token ids or dict is a batch of one."""
    if isinstance(prompts, str | dict | Encoded):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    for p in prompts:
        if not isinstance(p, str | list | tuple | dict | Encoded):
            raise TypeError(f"a prompt must be a string, a list of token ids or a dict, got {type(p).__name__}")
        if isinstance(p, dict):
            check_prompt_dict(p)
    return [list(p) if isinstance(p, tuple) else p for p in prompts]


def check_prompt_dict(p: dict) -> None:
    """vLLM's prompt dict: exactly one of "prompt" and "prompt_token_ids", and images only."""
    if unknown := sorted(set(p) - PROMPT_KEYS):
        raise ValueError(f"prompt: unknown key {unknown[0]!r} (known: {sorted(PROMPT_KEYS)})")
    if ("prompt" in p) == ("prompt_token_ids" in p):
        raise ValueError("prompt: give exactly one of 'prompt' and 'prompt_token_ids'")
    media = p.get("multi_modal_data") or {}
    if not isinstance(media, dict) or (other := sorted(set(media) - {"image"})):
        got = other if isinstance(media, dict) else type(media).__name__
        raise ValueError(f"prompt: multi_modal_data takes 'image' only, got {got}")


def prompt_images(p: dict) -> list:
    """A prompt dict's images, as a list."""
    images = (p.get("multi_modal_data") or {}).get("image") or []
    return list(images) if isinstance(images, list | tuple) else [images]


def with_loras(params: list[SamplingParams], lora) -> list[SamplingParams]:
    """Each prompt's parameters with its adapter (vLLM's lora_request: one for all, or a list)."""
    if lora is None:
        return params
    loras = list(lora) if isinstance(lora, list | tuple) else [lora] * len(params)
    if len(loras) != len(params):
        raise ValueError(f"lora_request: {len(loras)} given for {len(params)} prompts")
    return [dataclasses.replace(p, lora_request=x) if x is not None else p for p, x in zip(params, loras)]


def with_priorities(params: list[SamplingParams], priority) -> list[SamplingParams]:
    """Each prompt's parameters with its scheduling priority (vLLM's LLM.generate `priority`: one
    per prompt; RequestLimits refuses one other than 0 unless the engine schedules by priority)."""
    if priority is None:
        return params
    if len(priority) != len(params):
        raise ValueError(f"priority: {len(priority)} given for {len(params)} prompts")
    return [dataclasses.replace(p, priority=x) for p, x in zip(params, priority)]


def as_params_list(sp, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: the same one n times, or a list of exactly n."""
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sp = list(sp)
    if len(sp) != n:
        raise ValueError(f"got {len(sp)} SamplingParams for {n} prompts")
    return sp
