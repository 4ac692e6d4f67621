"""Pipeline micro-batching does not change a request's greedy result on the default model
(SmolLM2-135M-Instruct, Q4_1 GGUF): with two micro-batches in flight a step's requests are split
in two, with one they share every product, and one process runs them all; the tokens and their
logprobs are the same bit for bit (the products' one arithmetic at every batch size,
layers/csrc/quant_x16.c). Before it, 16-bit activations below 10 rows and float panels above
gave other tokens at PP 2 with 2 micro-batches than with 1."""

from __future__ import annotations

import pytest
import torch

from shardserve.llm import LLM
from shardserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, logprobs=2)


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(5, 64, (n,), generator=g).tolist()
    return [torch.randint(100, 40000, (k,), generator=g).tolist() for k in lens]


@pytest.mark.slow
def test_pp_micro_batches_give_one_process_results(smollm2_path):
    batch = prompts(20)  # 10 rows a micro-batch: the old crossover between product paths
    with LLM(smollm2_path, show_progress=False, enable_prefix_cache=False) as one:
        want = [(o.token_ids, o.logprobs) for o in one.generate(batch, GREEDY, use_tqdm=False)]
    for k in (2, 1):
        with LLM(smollm2_path, pp_size=2, pp_micro_batches=k, kv_cache_memory=2**27, enable_prefix_cache=False,
                 show_progress=False) as llm:
            got = [(o.token_ids, o.logprobs) for o in llm.generate(batch, GREEDY, use_tqdm=False)]
            in_flight = llm.stats().max_in_flight
        assert in_flight == k
        assert got == want, f"pp_micro_batches={k}"
