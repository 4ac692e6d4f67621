"""A request's greedy result does not depend on what shares its steps, on how its prompt was
chunked, or on whether its prefix came from the cache: the same tokens and the same logprobs,
bit for bit, on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF).

It rests on the products (every Q4_1/Q8_0 product runs one arithmetic whatever its number of rows:
layers/csrc/quant_x16.c) and on attention (a prefill token attends by the decode kernel, to the
cache up to its own position: attention/metadata.py). Before them, 16-bit activations below 10
rows and float panels above gave a request other logits beside other requests or after a cached
prefix, and a token prefilled (by SDPA) got other logits than the same token decoded.
"""

from __future__ import annotations

import pytest
import torch

from shardserve.llm import LLM
from shardserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, logprobs=2)


def prompts(n: int, seed: int, lo: int = 5, hi: int = 300) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(100, 40000, (k,), generator=g).tolist() for k in lens]


TARGET = prompts(1, seed=7, lo=40, hi=41)[0]


def result(llm: LLM, batch: list[list[int]], index: int) -> tuple[list[int], list[dict]]:
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    return outs[index].token_ids, outs[index].logprobs


@pytest.fixture(scope="module")
def uncached(smollm2_path: str) -> LLM:
    return LLM(model=smollm2_path, show_progress=False, enable_prefix_cache=False)


@pytest.fixture(scope="module")
def alone(uncached: LLM) -> tuple[list[int], list[dict]]:
    return result(uncached, [TARGET], 0)


@pytest.mark.parametrize("size", [5, 13, 32])
def test_alone_equals_in_a_batch(uncached: LLM, alone, size: int) -> None:
    others = prompts(size - 1, seed=size)
    batch = others[: size // 2] + [TARGET] + others[size // 2:]  # prefills and decodes around it
    tokens, logprobs = result(uncached, batch, size // 2)
    assert tokens == alone[0]
    assert logprobs == alone[1]  # every logprob exactly, not within a tolerance


def test_chunked_prefill_equals_one_chunk(smollm2_path: str) -> None:
    long = prompts(1, seed=11, lo=300, hi=301)[0]
    whole = LLM(model=smollm2_path, show_progress=False, enable_prefix_cache=False)
    want = result(whole, [long], 0)
    whole.shutdown()
    chunked = LLM(model=smollm2_path, show_progress=False, enable_prefix_cache=False,
                  max_num_batched_tokens=64)  # the prompt in five chunks
    assert result(chunked, [long], 0) == want
    chunked.shutdown()


def test_cached_prefix_equals_uncached(smollm2_path: str, uncached: LLM) -> None:
    shared = prompts(1, seed=12, lo=256, hi=257)[0]
    first, second = shared + [501, 502, 503], shared + [601, 602]
    want = [result(uncached, [p], 0) for p in (first, second)]
    llm = LLM(model=smollm2_path, show_progress=False)
    cold = llm.generate([first], GREEDY, use_tqdm=False)[0]
    warm = llm.generate([first, second], GREEDY, use_tqdm=False)
    assert cold.num_cached_tokens == 0 and min(o.num_cached_tokens for o in warm) >= 256
    assert (cold.token_ids, cold.logprobs) == want[0]
    assert [(o.token_ids, o.logprobs) for o in warm] == want
    llm.shutdown()


def test_prefilled_output_equals_its_decode(uncached: LLM, alone) -> None:
    """The tokens a request generated, given back as prompt (a preempted request recomputing its
    output, the next turn of a chat), lead to the same continuation with the same logprobs: a
    prefill token and a decoded one are computed alike."""
    tokens, logprobs = alone
    again = uncached.generate([TARGET + tokens[:12]], SamplingParams(max_tokens=12, temperature=0, logprobs=2),
                              use_tqdm=False)[0]
    assert again.token_ids == tokens[12:]
    assert again.logprobs == logprobs[12:]


def test_float_checkpoint_alone_equals_in_a_batch(tiny_model) -> None:
    """The same holds for a float32 checkpoint: its weights are F32 rows in the x16 layout, one
    order of multiply-adds per output at every batch size."""
    path, _ = tiny_model("llama")
    llm = LLM(model=path, show_progress=False, enable_prefix_cache=False)
    target = [5, 9, 2, 77, 3, 40, 41]
    alone = result(llm, [target], 0)
    others = [[(7 * i + j) % 250 + 3 for j in range(3 + 5 * i)] for i in range(12)]
    assert result(llm, others[:6] + [target] + others[6:], 6) == alone
    llm.shutdown()


def test_the_setting_is_honoured_or_refused(tiny_model) -> None:
    """batch_invariant: on by default where the CPU decode kernel runs (prefill tokens attend by
    it), off on request (SDPA), and refused in one line where that kernel cannot run."""
    from shardserve.config import EngineConfig
    from shardserve.scheduler.engine_core import EngineCore

    path, _ = tiny_model("llama")
    on = EngineCore(EngineConfig(model=path, show_progress=False, num_pages=32)).runner
    off = EngineCore(EngineConfig(model=path, show_progress=False, num_pages=32, batch_invariant=False)).runner
    assert on.attention.name == off.attention.name == "cpu"
    assert on.attention.batch_invariant and not off.attention.batch_invariant
    with pytest.raises(ValueError, match="--batch-invariant needs the CPU attention kernel .* torch"):
        EngineCore(EngineConfig(model=path, show_progress=False, num_pages=32, attention_backend="torch",
                                batch_invariant=True))
