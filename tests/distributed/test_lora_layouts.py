"""Multi-LoRA under tensor, pipeline, data and context parallelism: the adapters shard with their layers
(both --fully-sharded-loras modes, an uneven TP 3 among them), each data-parallel replica keeps its
own slots, and every layout gives PEFT's tokens and logprobs for a batch mixing three adapters and
the base model in two slots, so adapters are evicted and loaded again on every rank while the batch
runs."""

from __future__ import annotations

import shutil

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


@pytest.mark.slow
def test_moe_attention_adapters_under_dp_attention(tiny_model, tmp_path):
    """A MoE model takes adapters on its attention projections (its experts take none); under
    data-parallel attention (T 4 x D 2: attention TP 2 in each replica) each replica's slots serve
    them, equal to PEFT; an adapter on the MoE block's MLP names is refused."""
    from lora_util import peft_greedy, save_adapter

    from shardserve import LoRARequest

    path, base = tiny_model("qwen3_moe")
    specs = {"qkvo": (1, 4, 8, ("q_proj", "k_proj", "v_proj", "o_proj"), False),
             "qo": (2, 8, 4, ("q_proj", "o_proj"), True)}
    reqs, ref = {}, {"base": [peft_greedy(base, p, NEW) for p in PROMPTS]}
    for i, (name, spec) in enumerate(specs.items(), start=1):
        model = save_adapter(base, str(tmp_path / name), *spec)
        reqs[name] = LoRARequest(name, i, str(tmp_path / name))
        ref[name] = [peft_greedy(model, p, NEW) for p in PROMPTS]
    names = [n for n in ("base", *reqs) for _ in PROMPTS]
    with LLM(path, tp_size=4, dp_size=2, enable_dp_attention=True, enable_lora=True, max_loras=1, max_lora_rank=8,
             num_pages=64, show_progress=False) as llm:
        outs = llm.generate(PROMPTS * 3, GREEDY, use_tqdm=False, lora_request=[reqs.get(n) for n in names])
        check_outputs(outs, names, ref, PROMPTS)
        mlp = tmp_path / "mlp"
        shutil.copytree(tmp_path / "qo", mlp)
        _rename_to_mlp(mlp / "adapter_model.safetensors")
        with pytest.raises(ValueError, match="target module 'gate_proj' is not one this model adapts"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("mlp", 3, str(mlp)))


def _rename_to_mlp(path) -> None:
    """An adapter file whose q_proj matrices are renamed to a dense MLP's gate_proj."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    save_file({k.replace("self_attn.q_proj", "mlp.gate_proj"): v for k, v in tensors.items()}, str(path))
