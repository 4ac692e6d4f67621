"""The offline API's arguments as `LLM.generate` takes them, normalized into one entry per prompt:
a prompt is text or token ids, alone or in a list; SamplingParams and LoRA adapters come one for
every prompt or one each."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from shardserve.sampling_params import SamplingParams

Prompt = str | list[int]


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """The prompts as a list: one string or one list of token ids is a batch of one."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    for p in prompts:
        if not isinstance(p, str | list | tuple):
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(p).__name__}")
    return [p if isinstance(p, str) else list(p) for p in prompts]


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
