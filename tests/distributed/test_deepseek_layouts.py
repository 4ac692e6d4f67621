"""DeepSeek (latent attention, DeepSeekMoE) and Mixtral on every layout, each equal to
transformers: greedy tokens and log-probabilities within 1e-4.

Tensor parallelism splits the 6 query heads (2, 2, 1, 1 at TP 4) and replicates the latent
cache; data-parallel attention gives each replica its own latent cache while the experts spread
over every rank; pipeline stages, context parallelism (ring attention over latent blocks) and
replicas run the same arithmetic. The KV pool holds one latent + rotary key per token and layer.
"""

from __future__ import annotations

import pytest
import torch

from shardserve import LLM, SamplingParams

NEW = 8
ENGINE = dict(num_pages=96, page_size=8, max_num_batched_tokens=48, show_progress=False)
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, logprobs=1)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(vocab, (n,), generator=g).tolist() for n in (1, 9, 60)]


def assert_matches(model, outs, batch) -> None:
    for out, prompt in zip(outs, batch, strict=True):
        with torch.no_grad():
            seq = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            lps = torch.log_softmax(model(seq[:, :-1]).logits[0, len(prompt) - 1:].float(), -1)
        assert out.token_ids == seq[0, len(prompt):].tolist()
        for entry, row in zip(out.logprobs, lps, strict=True):
            assert abs(entry["logprob"] - float(row[entry["token_id"]])) < 1e-4


# (arch, layout): each layout once across the three models (CI time); TP 4 splits 6 heads unevenly.
MATRIX = [
    ("deepseek_v3", dict(tp_size=4)),
    ("deepseek_v2", dict(tp_size=2, pp_size=2)),
    ("deepseek_v3", dict(tp_size=4, dp_size=4, enable_dp_attention=True)),
    ("deepseek_v2", dict(tp_size=2, dp_size=2, enable_dp_attention=True)),
    ("deepseek_v3", dict(cp_size=2)),
    ("deepseek_v2", dict(dp_size=2)),
    ("mixtral", dict(tp_size=2, dp_size=2, enable_dp_attention=True)),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch,layout", MATRIX, ids=["-".join(f"{k.split('_')[0]}{v}" for k, v in lay.items()
                                                              if k != "enable_dp_attention") + f"-{a}"
                                                     for a, lay in MATRIX])
def test_layout_matches_transformers(tiny_model, arch, layout):
    path, model = tiny_model(arch)
    batch = prompts(model.config.vocab_size)
    with LLM(path, **layout, **ENGINE) as llm:
        assert_matches(model, llm.generate(batch, GREEDY, use_tqdm=False), batch)
        again = llm.generate(batch[2:], GREEDY, use_tqdm=False)  # its full pages from the prefix cache
    assert again[0].token_ids == outs_of(model, batch[2])
    if not layout.get("enable_dp_attention"):  # (its placement does not follow the cache)
        assert again[0].num_cached_tokens == 56


def outs_of(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False)[0, len(prompt):].tolist()
