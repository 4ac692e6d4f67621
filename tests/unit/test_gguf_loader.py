"""Tests for shardserve.loader.gguf_loader and gguf_metadata against transformers' own GGUF loader.

Runtime is dominated by transformers' reference dequantization, so the expensive objects live
in module-scoped fixtures.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from gguf_util import llama_cpp_permute

from shardserve.loader.gguf_loader import iter_gguf_tensors
from shardserve.loader.gguf_metadata import read_gguf_config
from shardserve.loader.gguf_tokenizer import load_gguf_tokenizer

# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ours(smollm2_path: str) -> dict:
    """Our (hf_name -> load_fn) map for SmolLM2, in file order."""
    return dict(iter_gguf_tensors(smollm2_path))


@pytest.fixture(scope="module")
def reference(smollm2_hf: torch.nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """transformers' dequantized GGUF tensors (as loaded into its model) and the state_dict keys."""
    state = smollm2_hf.state_dict()
    return state, set(state)


@pytest.fixture(scope="module")
def our_tokenizer(smollm2_path: str):
    return load_gguf_tokenizer(smollm2_path)


# ----------------------------------------------------------------------------- SmolLM2 (real file)


def test_config_matches_smollm2(smollm2_path: str) -> None:
    config = read_gguf_config(smollm2_path)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["attention_bias"] is False
    assert "num_experts" not in config


def test_all_names_map_to_state_dict(ours: dict, reference: tuple) -> None:
    _, state_dict_keys = reference
    assert len(ours) == 272
    assert set(ours) <= state_dict_keys
    # Tied embeddings: the file has no output.weight, so lm_head is the only key not yielded.
    assert state_dict_keys - set(ours) == {"lm_head.weight"}


def test_tensors_equal_transformers(ours: dict, reference: tuple) -> None:
    ref_tensors, _ = reference
    # Every tensor, not just a sample: q/k of every layer exercise the rope un-permutation.
    for name, load in ours.items():
        got, want = load(), ref_tensors[name]
        assert got.dtype == torch.float32, name
        assert got.shape == want.shape, name
        assert torch.allclose(got, want, rtol=0, atol=0), name
    for required in (
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
    ):
        assert required in ours


def test_tokenizer_matches_transformers(our_tokenizer, smollm2_path: str) -> None:
    from transformers import AutoTokenizer

    directory, name = os.path.split(smollm2_path)
    ref = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    text = "What is the capital of France?"
    assert our_tokenizer.encode(text) == ref.encode(text)
    assert (our_tokenizer.bos_token_id, our_tokenizer.eos_token_id) == (1, 2)


def test_tokenizer_chat_template(our_tokenizer) -> None:
    prompt = our_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nhi<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


# ----------------------------------------------------------------------------- synthetic files

HIDDEN, HEADS, KV_HEADS, FFN = 64, 4, 2, 96
HEAD_DIM = HIDDEN // HEADS


def _write_header(writer: GGUFWriter, arch: str, extra: dict[str, int] | None = None) -> None:
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(32)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    for key, value in (extra or {}).items():
        writer.add_uint32(f"{arch}.{key}", value)


def _finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, np.ndarray]]:
    """A one-layer llama GGUF with one tensor per storage type; returns (path, originals)."""
    rng = np.random.default_rng(0)
    originals = {
        "token_embd.weight": rng.standard_normal((32, HIDDEN), dtype=np.float32),
        "blk.0.attn_norm.weight": rng.standard_normal(HIDDEN, dtype=np.float32),
        "blk.0.attn_q.weight": rng.standard_normal((HIDDEN, HIDDEN), dtype=np.float32),
        "blk.0.attn_k.weight": rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN), dtype=np.float32),
        "blk.0.ffn_gate.weight": rng.standard_normal((FFN, HIDDEN), dtype=np.float32),
        "blk.0.ffn_up.weight": rng.standard_normal((FFN, HIDDEN), dtype=np.float32),
        "blk.0.ffn_down.weight": rng.standard_normal((HIDDEN, FFN), dtype=np.float32),
        "blk.0.attn_v.weight": rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN), dtype=np.float32),
        "rope_freqs.weight": rng.standard_normal(HEAD_DIM // 2, dtype=np.float32),
    }
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")
    writer = GGUFWriter(path, "llama")
    _write_header(writer, "llama")
    writer.add_tensor("token_embd.weight", originals["token_embd.weight"].astype(np.float16))
    writer.add_tensor("blk.0.attn_norm.weight", originals["blk.0.attn_norm.weight"])
    # Stored as llama.cpp would: rope-permuted rows. The loader must hand back the originals.
    writer.add_tensor("blk.0.attn_q.weight", llama_cpp_permute(originals["blk.0.attn_q.weight"], HEADS))
    writer.add_tensor("blk.0.attn_k.weight", llama_cpp_permute(originals["blk.0.attn_k.weight"], KV_HEADS))
    for name, qtype in (
        ("blk.0.ffn_gate.weight", GGMLQuantizationType.BF16),
        ("blk.0.ffn_up.weight", GGMLQuantizationType.Q8_0),
        ("blk.0.ffn_down.weight", GGMLQuantizationType.Q4_0),
        ("blk.0.attn_v.weight", GGMLQuantizationType.Q4_1),
    ):
        writer.add_tensor(name, quantize(originals[name], qtype), raw_dtype=qtype)
    writer.add_tensor("rope_freqs.weight", originals["rope_freqs.weight"])
    _finish(writer)
    return path, originals


def test_tiny_llama_config(tiny_llama: tuple) -> None:
    config = read_gguf_config(tiny_llama[0])
    assert config["hidden_size"] == HIDDEN
    assert config["head_dim"] == HEAD_DIM
    assert config["num_key_value_heads"] == KV_HEADS
    assert config["tie_word_embeddings"] is True


def test_tiny_llama_dequantization(tiny_llama: tuple) -> None:
    path, originals = tiny_llama
    got = {name: load() for name, load in iter_gguf_tensors(path)}

    def orig(gguf_name: str) -> torch.Tensor:
        return torch.from_numpy(originals[gguf_name])

    # F16 is exact to fp16 rounding; F32 exact; BF16 exact to round-to-nearest-even bf16.
    f16 = orig("token_embd.weight").half().float()
    assert torch.equal(got["model.embed_tokens.weight"], f16)
    assert torch.equal(got["model.layers.0.input_layernorm.weight"], orig("blk.0.attn_norm.weight"))
    bf16 = orig("blk.0.ffn_gate.weight").bfloat16().float()
    assert torch.equal(got["model.layers.0.mlp.gate_proj.weight"], bf16)

    # Q/K: llama.cpp's permutation is undone exactly (F32 storage, so bit-exact).
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"], orig("blk.0.attn_q.weight"))
    assert torch.equal(got["model.layers.0.self_attn.k_proj.weight"], orig("blk.0.attn_k.weight"))

    # Block quantization: worst-case error is half a step, plus one step where Q4_0 clips
    # the value opposite to the block's extreme. Bounds are relative to the tensor's |max|.
    for hf_name, gguf_name, rel_bound in (
        ("model.layers.0.mlp.up_proj.weight", "blk.0.ffn_up.weight", 1 / 127),  # Q8_0
        ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight", 1 / 7),  # Q4_0
        ("model.layers.0.self_attn.v_proj.weight", "blk.0.attn_v.weight", 1 / 14),  # Q4_1
    ):
        want = orig(gguf_name)
        assert got[hf_name].shape == want.shape
        err = (got[hf_name] - want).abs()
        assert err.max() <= rel_bound * want.abs().max(), hf_name
        assert err.mean() < 0.1 * want.abs().mean(), hf_name  # not just bounded: close

    # rope_freqs is the rotary's frequency divisors: read into the config, never a weight.
    assert "rope_freqs.weight" not in got
    factors = read_gguf_config(path)["rope_scaling"]["factors"]
    assert torch.equal(torch.tensor(factors), orig("rope_freqs.weight"))


def test_tiny_llama_is_lazy(tiny_llama: tuple) -> None:
    loaded: list[str] = []
    for name, load in iter_gguf_tensors(tiny_llama[0]):
        assert callable(load)
        loaded.append(name)
    assert loaded[0] == "model.embed_tokens.weight"  # file order preserved


N_EXPERTS, MOE_FFN, SHARED_FFN = 4, 32, 64


@pytest.fixture(scope="module")
def tiny_qwen2moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, np.ndarray]]:
    """A one-layer qwen2moe GGUF with stacked (Q8_0) experts and a shared expert."""
    rng = np.random.default_rng(1)
    originals = {
        "token_embd.weight": rng.standard_normal((32, HIDDEN), dtype=np.float32),
        "output.weight": rng.standard_normal((32, HIDDEN), dtype=np.float32),
        "blk.0.attn_q.weight": rng.standard_normal((HIDDEN, HIDDEN), dtype=np.float32),
        "blk.0.attn_q.bias": rng.standard_normal(HIDDEN, dtype=np.float32),
        "blk.0.ffn_gate_inp.weight": rng.standard_normal((N_EXPERTS, HIDDEN), dtype=np.float32),
        "blk.0.ffn_gate_exps.weight": rng.standard_normal((N_EXPERTS, MOE_FFN, HIDDEN), dtype=np.float32),
        "blk.0.ffn_down_exps.weight": rng.standard_normal((N_EXPERTS, HIDDEN, MOE_FFN), dtype=np.float32),
        "blk.0.ffn_up_shexp.weight": rng.standard_normal((SHARED_FFN, HIDDEN), dtype=np.float32),
        "blk.0.ffn_gate_inp_shexp.weight": rng.standard_normal(HIDDEN, dtype=np.float32),
    }
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-qwen2moe.gguf")
    writer = GGUFWriter(path, "qwen2moe")
    extra = {"expert_count": N_EXPERTS, "expert_used_count": 2}
    extra |= {"expert_feed_forward_length": MOE_FFN, "expert_shared_feed_forward_length": SHARED_FFN}
    _write_header(writer, "qwen2moe", extra)
    for name, array in originals.items():
        if name == "blk.0.ffn_gate_exps.weight":
            qtype = GGMLQuantizationType.Q8_0
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    _finish(writer)
    return path, originals


def test_tiny_qwen2moe_config(tiny_qwen2moe: tuple) -> None:
    config = read_gguf_config(tiny_qwen2moe[0])
    assert config["architectures"] == ["Qwen2MoeForCausalLM"]
    assert config["model_type"] == "qwen2_moe"
    assert config["num_experts"] == N_EXPERTS
    assert config["num_experts_per_tok"] == 2
    assert config["moe_intermediate_size"] == MOE_FFN
    assert config["shared_expert_intermediate_size"] == SHARED_FFN
    assert config["norm_topk_prob"] is False
    assert config["tie_word_embeddings"] is False
    assert config["attention_bias"] is True


def test_tiny_qwen2moe_tensors(tiny_qwen2moe: tuple) -> None:
    path, originals = tiny_qwen2moe
    got = {name: load() for name, load in iter_gguf_tensors(path)}
    layer = "model.layers.0."
    expected_names = {
        "model.embed_tokens.weight",
        "lm_head.weight",
        layer + "self_attn.q_proj.weight",
        layer + "self_attn.q_proj.bias",
        layer + "mlp.gate.weight",
        layer + "mlp.shared_expert.up_proj.weight",
        layer + "mlp.shared_expert_gate.weight",
    }
    for e in range(N_EXPERTS):
        expected_names |= {f"{layer}mlp.experts.{e}.gate_proj.weight", f"{layer}mlp.experts.{e}.down_proj.weight"}
    assert set(got) == expected_names

    # Qwen is not rope-permuted by llama.cpp: Q comes back untouched.
    assert torch.equal(got[layer + "self_attn.q_proj.weight"], torch.from_numpy(originals["blk.0.attn_q.weight"]))
    assert torch.equal(got[layer + "self_attn.q_proj.bias"], torch.from_numpy(originals["blk.0.attn_q.bias"]))
    gate = torch.from_numpy(originals["blk.0.ffn_gate_inp_shexp.weight"]).reshape(1, HIDDEN)
    assert torch.equal(got[layer + "mlp.shared_expert_gate.weight"], gate)
    for e in range(N_EXPERTS):
        down = torch.from_numpy(originals["blk.0.ffn_down_exps.weight"][e])
        assert torch.equal(got[f"{layer}mlp.experts.{e}.down_proj.weight"], down)
        gate_e = torch.from_numpy(originals["blk.0.ffn_gate_exps.weight"][e])
        got_gate = got[f"{layer}mlp.experts.{e}.gate_proj.weight"]
        assert got_gate.shape == (MOE_FFN, HIDDEN)
        assert (got_gate - gate_e).abs().max() <= gate_e.abs().max() / 127


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = str(tmp_path / "gemma.gguf")
    writer = GGUFWriter(path, "gemma")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    _finish(writer)
    with pytest.raises(ValueError, match="gemma"):
        read_gguf_config(path)
    with pytest.raises(ValueError, match="gemma"):
        next(iter_gguf_tensors(path))
