"""Multi-LoRA under tensor, pipeline, data and context parallelism: the adapters shard with their layers
(both --fully-sharded-loras modes, an uneven TP 3 among them), each data-parallel replica keeps its
own slots, and every layout gives PEFT's tokens and logprobs for a batch mixing three adapters and
the base model in two slots, so adapters are evicted and loaded again on every rank while the batch
runs."""

from __future__ import annotations

import pytest
from lora_util import adapter_set, check_outputs

from shardserve import LLM, SamplingParams

NEW = 10
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, logprobs=0)
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], list(range(40, 75))]


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    return adapter_set(tiny_model, tmp_path_factory.mktemp("adapters"), PROMPTS, NEW)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(tp_size=2, fully_sharded_loras=True),
                                    dict(tp_size=3, fully_sharded_loras=True), dict(pp_size=2), dict(dp_size=2),
                                    dict(cp_size=2)],
                         ids=["tp2", "tp2-fully-sharded", "tp3-fully-sharded", "pp2", "dp2", "cp2"])
def test_layouts_equal_peft(adapters, layout):
    path, reqs, ref = adapters
    names = [n for n in ("base", *reqs) for _ in PROMPTS]
    with LLM(path, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=8, num_pages=64,
             show_progress=False, **layout) as llm:
        outs = llm.generate(PROMPTS * 4, GREEDY, use_tqdm=False, lora_request=[reqs.get(n) for n in names])
        check_outputs(outs, names, ref, PROMPTS)
