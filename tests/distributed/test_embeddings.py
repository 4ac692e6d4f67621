"""Embeddings (LLM.embed, SamplingParams.pooling) against transformers' final hidden states: last-token and mean
pooling, normalized, within 1e-4, at TP 1 and 2, PP 2 and DP 2, over chunked prefill and beside a generation in the
same batch."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

from shardserve import LLM, SamplingParams

PROMPTS = [list(range(5, 28)), [3, 4, 5], [7] * 11]


def reference(path: str, mode: str) -> list[torch.Tensor]:
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = [model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]
    return [torch.nn.functional.normalize(h[-1] if mode == "last" else h.mean(0), dim=0) for h in hidden]


LAYOUTS = [("last", 1, 1, 1), ("mean", 1, 1, 1), ("last", 2, 1, 1), ("mean", 2, 1, 1), ("mean", 1, 2, 1),
           ("last", 1, 1, 2)]


@pytest.mark.parametrize("mode,tp,pp,dp", LAYOUTS, ids=[f"{m}-tp{t}-pp{p}-dp{d}" for m, t, p, d in LAYOUTS])
def test_embeddings_match_transformers(tiny_model, mode, tp, pp, dp):
    path, _ = tiny_model("qwen3")
    want = reference(path, mode)
    # 8 tokens a step: the 23-token prompt pools over three chunks.
    with LLM(path, tp_size=tp, pp_size=pp, dp_size=dp, pooling=mode, num_pages=64, page_size=8,
             max_num_batched_tokens=8, show_progress=False) as llm:
        got = llm.embed(PROMPTS, use_tqdm=False)
        # An embedding and a generation share the engine, and the embedding is no different for it.
        mixed = llm.generate([PROMPTS[0], PROMPTS[1]], [SamplingParams(max_tokens=6, temperature=0),
                                                       SamplingParams(max_tokens=1, pooling=mode)], use_tqdm=False)
    for g, w in zip(got, want):
        assert len(g.outputs.embedding) == w.numel()
        assert torch.allclose(torch.tensor(g.outputs.embedding), w, atol=1e-4)
    assert len(mixed[0].outputs[0].token_ids) == 6 and mixed[0].embedding is None
    assert torch.allclose(torch.nn.functional.normalize(torch.tensor(mixed[1].embedding), dim=0), want[1], atol=1e-4)


def test_embedding_refusals(tiny_model):
    path, _ = tiny_model("llama")
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(max_tokens=4, pooling="mean")  # an embedding generates nothing
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(max_tokens=1, pooling="cls")
    with LLM(path, num_pages=32, show_progress=False) as llm:
        with pytest.raises(ValueError, match="not trained for truncated embeddings"):
            llm.embed(PROMPTS[:1], dimensions=8)
