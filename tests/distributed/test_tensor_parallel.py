"""Tensor parallelism end to end: N scheduler processes on gloo give transformers' tokens.

The tiny models have vocab 301 (divisible by none of 2, 3, 4), 4 query heads and 2 KV heads
(fewer than 3 or 4 ranks, so KV heads replicate; at 3 ranks the query heads split 2/1/1), and
MoE models with 8 experts (uneven over 3 ranks)."""

from __future__ import annotations

import pytest
import torch
from engine_util import SMOLLM2_QUESTION

from shardserve import LLM, SamplingParams

NEW = 24
GREEDY = SamplingParams(max_tokens=NEW, temperature=0)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=5)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(vocab, (n,), generator=g).tolist() for n in (1, 9, 30)]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Per architecture: the prompts, transformers' greedy tokens, TP 1's greedy and seeded tokens."""
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            path, model = tiny_model(arch)
            batch = prompts(model.config.vocab_size)
            with torch.no_grad():
                hf = [model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                                     do_sample=False)[0, len(p):].tolist() for p in batch]
            with LLM(path, num_pages=64, show_progress=False) as one:
                tp1 = [o.token_ids for o in one.generate(batch, GREEDY, use_tqdm=False)]
                seeded = one.generate(batch[:1], SEEDED, use_tqdm=False)[0].token_ids
            cache[arch] = (path, batch, hf, tp1, seeded)
        return cache[arch]

    return get


# Qwen3 differs from Llama only in its q/k norms, which shard with the heads: TP 2 covers them
# (sizes 3 and 4 run on the other architectures; TP 4 on Qwen2-MoE only, TP 2 of a MoE on Qwen3-MoE
# only; CI time).
# Gemma 3 at TP 3: query heads 2/1/1 with their (1 + w) q/k norms, under windowed and full layers;
# Gemma 2 at TP 2: its capped scores on each rank's heads, its capped logits after the gather.
MATRIX = [(arch, tp) for arch in ("llama", "qwen3", "qwen3_moe", "qwen2_moe") for tp in (2, 3, 4)
          if (arch != "qwen3" or tp == 2) and (arch, tp) not in (("qwen3_moe", 4), ("qwen2_moe", 2), ("llama", 4))
          ] + [("gemma3", 3), ("gemma2", 2)]


@pytest.mark.parametrize("arch,tp", MATRIX, ids=[f"{a}-{t}" for a, t in MATRIX])
def test_tp_matches_transformers_and_tp1(reference, arch, tp):
    path, batch, hf, tp1, seeded = reference(arch)
    assert tp1 == hf
    with LLM(path, tp_size=tp, num_pages=64, page_size=8, show_progress=False) as llm:
        outs = [o.token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
        # Sampled (seeded) requests agree too: every rank draws the same tokens.
        sampled = llm.generate(batch[:1], SEEDED, use_tqdm=False)[0].token_ids
    assert outs == tp1
    assert sampled == seeded


def test_phi3_fused_checkpoint_tp3(tiny_model):
    """Phi-3's q/k/v and gate/up, fused in the checkpoint, split back then sharded over 3 ranks
    (query heads 2/1/1, KV heads replicated); 3/4 of each head rotated, LongRoPE's short factors
    (--max-model-len 64, its pretrained length, where transformers uses them for these lengths)."""
    path, model = tiny_model("phi3_longrope")
    batch = prompts(model.config.vocab_size)
    with torch.no_grad():
        hf = [model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False)[0, len(p):].tolist() for p in batch]
    with LLM(path, tp_size=3, num_pages=64, page_size=8, max_model_len=64, show_progress=False) as llm:
        assert [o.token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)] == hf


# 9 heads over 2 ranks: 5 + 4 query heads and a KV head group straddling them. Sizes 3 and 4
# (uneven, replicated KV heads) run on the tiny models above; CI time keeps the real model at one.
@pytest.mark.parametrize("tp", [2])
def test_smollm2_tp_answers_paris_with_tp1_tokens(smollm2_path, smollm2_answer, tp):
    greedy = SamplingParams(max_tokens=16, temperature=0)
    with LLM(smollm2_path, tp_size=tp, kv_cache_memory=2**27, show_progress=False) as llm:
        out = llm.chat(SMOLLM2_QUESTION, greedy, use_tqdm=False)
    assert "Paris" in out.text
    assert out.token_ids == smollm2_answer.token_ids


@pytest.mark.parametrize("tp", [2, 3])
def test_tp_through_the_triton_backend(reference, tp):
    """The Triton paged kernels (under the interpreter here) at TP 2 and at TP 3, where a KV head
    is replicated and query groups are uneven (one head per kernel program)."""
    path, batch, hf, _, _ = reference("llama")
    with LLM(path, tp_size=tp, num_pages=64, page_size=8, attention_backend="triton", show_progress=False) as llm:
        outs = [o.token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
        attention = {info["attention"] for info in llm.worker_info.values()}
    assert outs == hf
    assert attention == {"triton (interpreted on the CPU)"}


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_tp2_bfloat16_matches_tp1(reference, arch):
    """--dtype bfloat16 on the CPU (bfloat16 rows in the C kernels, float32 around them) shards
    as float32 does: TP 2 gives TP 1's greedy tokens (a row-parallel product's halves are summed
    in float32 by the all-reduce, so only a near tie could go the other way; none does here)."""
    path, batch, _, _, _ = reference(arch)
    with LLM(path, dtype="bfloat16", num_pages=64, show_progress=False) as one:
        tp1 = [o.token_ids for o in one.generate(batch, GREEDY, use_tqdm=False)]
    with LLM(path, tp_size=2, dtype="bfloat16", num_pages=64, page_size=8, show_progress=False) as llm:
        outs = [o.token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
        offered = {info["quantization"] for info in llm.worker_info.values()}
    assert outs == tp1
    assert offered == {"bf16"}  # both ranks took bfloat16 rows
