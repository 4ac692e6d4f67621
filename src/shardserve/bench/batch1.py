"""One stream's decode speed on our engine (bench offline and its llama.cpp comparison)."""

from __future__ import annotations

import time

from shardserve.core import SamplingParams
from shardserve.llm import LLM
from shardserve.structured_outputs import StructuredOutputsParams


def batch1_ours(llm: LLM, prompt: list[int], k: int, spec: StructuredOutputsParams | None = None) -> float:
    """Decode tokens/s of one request alone, excluding its first token (the prefill)."""
    t1 = 0.0
    params = SamplingParams(max_tokens=k, temperature=0, ignore_eos=True, structured_outputs=spec)
    for out in llm.stream(prompt, params):
        if not t1 and out.new_ids:
            t1 = time.perf_counter()
    return (k - 1) / (time.perf_counter() - t1)
