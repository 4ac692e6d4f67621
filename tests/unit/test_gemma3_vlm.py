"""Gemma 3's 4B-27B checkpoints (Gemma3ForConditionalGeneration: a vision tower beside the text
model; images: test_gemma3_images.py) on text prompts: greedy tokens and logits, whether the checkpoint names
its tensors as the Hub's files (and transformers' save_pretrained) do or as transformers' modules
are named; the config's sparse text_config read with Gemma3TextConfig's defaults."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_equivalence import hf_reference, prompts, run_engine
from tiny_models import COMMON, GEMMA3
from tiny_tokenizer import save_tiny_tokenizer
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

from shardserve.config import ModelConfig
from shardserve.sampling_params import SamplingParams

VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    torch.manual_seed(1234)
    text = Gemma3TextConfig(**copy.deepcopy(GEMMA3) | COMMON)
    cfg = Gemma3Config(text_config=text, vision_config=SiglipVisionConfig(**VISION), mm_tokens_per_image=4,
                       image_token_index=300, boi_token_index=298, eoi_token_index=299)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for name, p in model.named_parameters():
            if "language_model" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 if "norm" in name else p * 4.0)
    path = str(tmp_path_factory.mktemp("gemma3_vlm"))
    model.save_pretrained(path)
    save_tiny_tokenizer(path, COMMON["vocab_size"])
    return path, model


def test_text_model_served_from_either_naming(vlm, tmp_path):
    path, model = vlm
    names = list(load_file(f"{path}/model.safetensors"))
    # The Hub's names: language_model.model.*, and vision_tower.* / multi_modal_projector.* read past
    assert any(n.startswith("language_model.model.layers.") for n in names)
    assert any(n.startswith("vision_tower.") for n in names)
    batch = prompts(COMMON["vocab_size"])
    tokens, logits, core = run_engine(path, batch)
    assert type(core.runner.model).__name__ == "Gemma3ForConditionalGeneration" and core.runner.window == 16
    for p, toks, lg in zip(batch, tokens, logits):
        ref_tokens, ref_logits = hf_reference(model, p)
        assert toks == ref_tokens
        torch.testing.assert_close(lg, ref_logits, atol=1e-4, rtol=1e-4)
    # The modules' names: model.language_model.*, model.vision_tower.*, model.multi_modal_projector.*
    modules = tmp_path / "modules"
    modules.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (modules / f).write_bytes(open(f"{path}/{f}", "rb").read())
    module_names = (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
                    ("multi_modal_projector.", "model.multi_modal_projector."), ("", ""))
    renamed = {}
    for n, t in load_file(f"{path}/model.safetensors").items():
        theirs, ours = next((a, b) for a, b in module_names if n.startswith(a))
        renamed[ours + n[len(theirs):]] = t
    assert any(n.startswith("model.language_model.layers.") for n in renamed)
    save_file(renamed, str(modules / "model.safetensors"))
    assert run_engine(str(modules), batch)[0] == tokens


def test_sparse_text_config_reads_as_transformers_does():
    """gemma-3-4b-it's config.json as the Hub has it: text_config states six keys, the rest are
    Gemma3TextConfig's defaults; eos at the top."""
    d = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
         "torch_dtype": "bfloat16", "boi_token_index": 255999, "eoi_token_index": 256000,
         "image_token_index": 262144, "mm_tokens_per_image": 256,
         "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                           "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                           "patch_size": 14, "vision_use_head": False},
         "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                         "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                         "sliding_window": 1024}}
    ref = Gemma3Config.from_dict(json.loads(json.dumps(d))).text_config
    mc = ModelConfig.from_dict(d)
    for ours, theirs in (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                         ("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"),
                         ("head_dim", "head_dim"), ("query_pre_attn_scalar", "query_pre_attn_scalar"),
                         ("max_position_embeddings", "max_position_embeddings"), ("rms_norm_eps", "rms_norm_eps"),
                         ("sliding_window", "sliding_window"), ("num_layers", "num_hidden_layers")):
        assert getattr(mc, ours) == getattr(ref, theirs), ours
    assert [mc.windowed(i) for i in range(34)] == [t == "sliding_attention" for t in ref.layer_types]
    assert (mc.rope_theta, mc.window_rope_theta) == (ref.rope_parameters["full_attention"]["rope_theta"],
                                                     ref.rope_parameters["sliding_attention"]["rope_theta"])
    assert (mc.rope_scaling.kind, mc.rope_scaling.factor) == ("linear", 8.0)
    assert mc.eos_token_ids == (1, 106) and mc.bos_token_id == 2 and mc.tie_word_embeddings
    assert mc.architecture == "Gemma3ForConditionalGeneration" and mc.torch_dtype == "bfloat16"
    full = Gemma3Config.from_dict(json.loads(json.dumps(d)))
    vc, v = full.vision_config, mc.vision
    assert (v.hidden_size, v.intermediate_size, v.num_layers, v.num_heads, v.image_size, v.patch_size) == (
        vc.hidden_size, vc.intermediate_size, vc.num_hidden_layers, vc.num_attention_heads, vc.image_size,
        vc.patch_size)
    assert (v.image_token_id, v.boi_token_id, v.eoi_token_id, v.tokens_per_image, v.text_hidden_size) == (
        full.image_token_id, full.boi_token_index, full.eoi_token_index, full.mm_tokens_per_image, 2560)
    with pytest.raises(ValueError, match="quantization_config 'awq'"):  # at the top, beside text_config
        ModelConfig.from_dict(d | {"quantization_config": {"quant_method": "awq"}})


def test_adapter_on_the_language_model_equals_peft(vlm, tmp_path):
    """A PEFT adapter of the multimodal checkpoint on its language model's projections: PEFT's tokens."""
    from lora_util import peft_greedy, save_adapter

    from shardserve import LLM, LoRARequest

    path, model = vlm
    peft = save_adapter(model, str(tmp_path / "a"), 5, 4, 8,
                        r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)", False)
    batch = [p * 3 for p in prompts(COMMON["vocab_size"])[1:]]
    ref = [peft_greedy(peft, p, 8)[0] for p in batch]
    assert ref != [peft_greedy(model, p, 8)[0] for p in batch]
    with LLM(path, enable_lora=True, max_lora_rank=8, num_pages=64, show_progress=False) as llm:
        outs = llm.generate(batch, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False,
                            lora_request=LoRARequest("a", 1, str(tmp_path / "a")))
    assert [o.outputs[0].token_ids for o in outs] == ref
