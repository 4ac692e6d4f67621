"""--async-scheduling under tensor parallelism: the sampling rank sends each step's placeholder
tokens to its tensor peers (one broadcast of a few int64s), and every request's tokens and
logprobs equal synchronous scheduling's at the same TP size, on the default model."""

from __future__ import annotations

import pytest

from shardserve.llm import LLM
from tests.unit.test_async_scheduling import mixed_params, prompts


def tensor_broadcasts(llm: LLM) -> float:
    """Broadcast calls in tensor groups, over every rank."""
    return sum(r["groups"].get("tensor", {}).get("broadcast", {}).get("calls", 0) for r in llm.rank_reports())


@pytest.mark.slow
def test_tp2_async_equals_tp2_sync(smollm2_path: str) -> None:
    batch, params = prompts(10, seed=11), mixed_params(10)
    runs = {}
    for mode in (False, True):
        with LLM(smollm2_path, tp_size=2, async_scheduling=mode, kv_cache_memory=2**27, show_progress=False) as llm:
            outs = llm.generate(batch, params, use_tqdm=False)
            runs[mode] = ([(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].finish_reason)
                           for o in outs], llm.stats().max_in_flight, tensor_broadcasts(llm))
    (want, sync_depth, sync_casts), (got, depth, casts) = runs[False], runs[True]
    assert got == want
    assert (sync_depth, depth) == (1, 2)
    assert casts > sync_casts + 20  # the placeholders' tokens went to the other rank, step after step
