"""Gemma 2 and 3 GGUFs as llama.cpp's converter writes them: every norm weight stored as 1 + w,
the window but no layer pattern (llama.cpp takes every other layer as full for gemma2, every
sixth for gemma3) and no query scale (the head width, but 27B's); gemma3's global RoPE base and
its windowed layers' (`rope.freq_base_swa`), gemma2's caps. Served from the file, each gives the
original model's greedy tokens and logits (transformers on the Hugging Face checkpoint)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize
from gguf_util import finish, gguf_writer
from test_gguf_rope_factors import check
from tiny_models import COMMON, GEMMA2, GEMMA3, make_tiny_config
from transformers import Gemma2Config, Gemma3TextConfig

from shardserve.loader.gguf_metadata import read_gguf_config

STEMS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "post_feedforward_layernorm": "post_ffw_norm"}
QUANTIZED = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Six layers, the sixth attending fully (Gemma 3's pattern, which llama.cpp assumes), queries
    scaled by the head width (16, as the 270M-12B's are), a 16-token window."""
    path = str(tmp_path_factory.mktemp("gemma3_6"))
    cfg = Gemma3TextConfig(**copy.deepcopy(GEMMA3) | COMMON | {"num_hidden_layers": 6, "sliding_window_pattern": 6,
                                                                "query_pre_attn_scalar": 16})
    return make_tiny_config(cfg, path)


def write_gemma3(path: str, model, quantized: tuple[str, ...] = (), arch: str = "gemma3", **extra) -> None:
    """As convert_hf_to_gguf.py's Gemma3Model (or Gemma2Model) writes it (tied: no output.weight);
    Q8_0 for the `quantized` stems; `extra`: more {arch}.* keys (int, or a list of bools)."""
    cfg, sd = model.config, {k: v.numpy() for k, v in model.state_dict().items()}
    rope = cfg.rope_parameters
    w = gguf_writer(path, arch, cfg, theta=rope["full_attention"]["rope_theta"] if arch == "gemma3" else None)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if arch == "gemma3":
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    else:  # gemma2: the caps
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)
    w.add_vocab_size(cfg.vocab_size)
    for key, value in extra.items():
        (w.add_array if isinstance(value, list) else w.add_uint32)(f"{arch}.{key}", value)

    def norm(t: np.ndarray) -> np.ndarray:
        return t + np.float32(1.0)  # the converter's norm_shift

    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", norm(sd["model.norm.weight"]))
    for i in range(cfg.num_hidden_layers):
        for hf, stem in STEMS.items():
            if f"model.layers.{i}.{hf}.weight" not in sd:  # gemma2: no q/k norms
                continue
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if stem.endswith("norm"):
                w.add_tensor(f"blk.{i}.{stem}.weight", norm(t))
            elif stem in quantized:
                w.add_tensor(f"blk.{i}.{stem}.weight", quantize(t, T.Q8_0), raw_dtype=T.Q8_0)
            else:
                w.add_tensor(f"blk.{i}.{stem}.weight", t)
    finish(w)


def test_gemma3_gguf_equals_the_checkpoint(gemma, tmp_path):
    """Layers 0-4 windowed with base 1000, layer 5 full with base 100000 and linear scaling; the
    norms hold the file's 1 + w exactly (taken off on load, added back in float32)."""
    path = str(tmp_path / "gemma3.gguf")
    write_gemma3(path, gemma)
    core = check(path, gemma, (1, 20, 40))
    mc = core.runner.model_cfg
    assert (mc.full_layers, core.runner.window, mc.window_rope_theta, mc.rope_theta) == ((5,), 16, 1000.0, 1e5)
    assert (mc.query_pre_attn_scalar, mc.mlp_activation, mc.rope_scaling.kind) == (16, "gelu_pytorch_tanh", "linear")
    file_norm = gemma.model.layers[2].post_feedforward_layernorm.weight.detach() + 1.0
    assert torch.equal(core.runner.model.layers[2].post_feedforward_layernorm.weight, file_norm)


def test_gemma3_q8_0_gguf_equals_its_dequantized_weights(gemma, tmp_path):
    """Q8_0 products expanded to float32 (--quantization none): transformers on the same
    dequantized weights is the oracle, to 1e-4."""
    path = str(tmp_path / "gemma3-q8.gguf")
    write_gemma3(path, gemma, quantized=QUANTIZED)
    ref = copy.deepcopy(gemma)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            stem = next((s for hf, s in STEMS.items() if f".{hf}." in name), None)
            if stem in QUANTIZED:
                p.copy_(torch.from_numpy(dequantize(quantize(p.numpy(), T.Q8_0), T.Q8_0)))
    check(path, ref, (1, 20, 40), quantization="none")


@pytest.mark.parametrize("extra,full", [
    ({}, (5,)),  # llama.cpp's default: every sixth
    ({"attention.sliding_window_pattern": 2}, (1, 3, 5)),
    ({"attention.sliding_window_pattern": [True, False, True, True, False, True]}, (1, 4)),
])
def test_gemma3_gguf_layer_pattern(gemma, tmp_path, extra, full):
    path = str(tmp_path / "pattern.gguf")
    write_gemma3(path, gemma, **extra)
    from shardserve.config import ModelConfig

    mc = ModelConfig.from_dict(read_gguf_config(path))
    assert mc.full_layers == full and mc.sliding_window == 16


def test_gemma3_gguf_27b_query_scale(tmp_path):
    """llama.cpp's rule for 27B (62 layers): queries scaled by hidden / heads (168 for the real
    model), as its config's query_pre_attn_scalar; the others by the head width."""
    from shardserve.config import ModelConfig

    path = str(tmp_path / "wide.gguf")
    w = GGUFWriter(path, "gemma3")
    for add, value in ((w.add_block_count, 62), (w.add_context_length, 512), (w.add_embedding_length, 5376),
                       (w.add_feed_forward_length, 96), (w.add_head_count, 32), (w.add_head_count_kv, 16),
                       (w.add_key_length, 128), (w.add_value_length, 128), (w.add_layer_norm_rms_eps, 1e-6),
                       (w.add_rope_freq_base, 1e6), (w.add_vocab_size, 301)):
        add(value)
    finish(w)
    mc = ModelConfig.from_dict(read_gguf_config(path))
    assert (mc.query_pre_attn_scalar, mc.head_dim, mc.sliding_window, mc.window_rope_theta) == (168, 128, None, 1e4)


def test_gemma2_gguf_equals_the_checkpoint(tmp_path):
    """Every other layer windowed (llama.cpp's gemma2 default), scores capped at 5 and logits at 3
    as the file says, the norms' 1 + w taken back."""
    model = make_tiny_config(Gemma2Config(**GEMMA2 | COMMON | {"num_hidden_layers": 4, "query_pre_attn_scalar": 16}),
                             str(tmp_path / "hf"))
    path = str(tmp_path / "gemma2.gguf")
    write_gemma3(path, model, arch="gemma2")
    core = check(path, model, (1, 20, 40))
    mc = core.runner.model_cfg
    assert (mc.full_layers, mc.attn_logit_softcap, mc.final_logit_softcap, mc.window_rope_theta) == ((1, 3), 5, 3, None)
