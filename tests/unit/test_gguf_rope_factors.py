"""GGUFs whose rotary scaling is stored as tensors, as llama.cpp's converter writes them: llama
3.x's "llama3" scaling as `rope_freqs` divisors (and no scaling metadata), and Phi-3's LongRoPE
sets beside its fused q/k/v and gate/up and partial rotary. Served from the file, each gives the
original model's greedy tokens and logits (transformers on the Hugging Face checkpoint)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize
from gguf_util import finish, gguf_writer, llama_cpp_permute
from test_equivalence import hf_reference, run_engine

LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.o_proj": "attn_output",
         "mlp.down_proj": "ffn_down"}
LLAMA = LAYER | {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up"}
PHI3 = LAYER | {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def llama3_rope_freqs(cfg) -> np.ndarray:
    """The divisors llama.cpp's converter writes for "llama3" scaling (generate_extra_tensors)."""
    rope, dim = cfg.rope_parameters, head_dim(cfg)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(path: str, arch: str, model, names: dict[str, str], extra: dict[str, np.ndarray],
               quantized: tuple[str, ...] = ()) -> None:
    """`model`'s weights as llama.cpp lays them out (tied: no output.weight), float32 but for the
    `quantized` stems (Q8_0), plus the `extra` whole-model tensors."""
    cfg, sd = model.config, {k: v.numpy() for k, v in model.state_dict().items()}
    w = gguf_writer(path, arch, cfg)
    w.add_rope_dimension_count(int(head_dim(cfg) * cfg.rope_parameters.get("partial_rotary_factor", 1.0)))
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings)))
        w.add_sliding_window(0)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, stem in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if arch == "llama" and stem in ("attn_q", "attn_k"):
                t = llama_cpp_permute(t, cfg.num_attention_heads if stem == "attn_q" else cfg.num_key_value_heads)
            if stem in quantized:
                w.add_tensor(f"blk.{i}.{stem}.weight", quantize(t, T.Q8_0), raw_dtype=T.Q8_0)
            else:
                w.add_tensor(f"blk.{i}.{stem}.weight", t)
    for name, t in extra.items():
        w.add_tensor(name, t)
    finish(w)


def check(path: str, model, lengths: tuple[int, ...], **cfg):
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    tokens, logits, core = run_engine(path, batch, **cfg)
    for p, toks, lg in zip(batch, tokens, logits):
        ref_tokens, ref_logits = hf_reference(model, p)
        assert toks == ref_tokens
        torch.testing.assert_close(lg, ref_logits, atol=1e-4, rtol=1e-4)
    return core


def test_llama3_scaling_from_rope_freqs(tiny_model, tmp_path):
    """Llama 3.1-3.3's GGUFs: before, rope_freqs.weight was refused as an unexpected tensor."""
    _, model = tiny_model("llama_tied")  # llama3 scaling past 64 pretrained positions
    path = str(tmp_path / "llama3.gguf")
    write_gguf(path, "llama", model, LLAMA, {"rope_freqs.weight": llama3_rope_freqs(model.config)})
    core = check(path, model, (1, 30, 90))
    assert core.runner.model_cfg.rope_scaling.kind == "freq_factors"


@pytest.mark.parametrize("max_model_len,lengths", [(None, (65, 90)), (64, (7, 30))])
def test_phi3_longrope_fused_partial(tiny_model, tmp_path, max_model_len, lengths):
    """LongRoPE's sets from rope_factors_long/short, the attention factor and original length from
    metadata, the rotated width from rope.dimension_count (12 of 16), attn_qkv and ffn_up (gate
    and up) split back; long factors served past 64 positions, short ones within."""
    _, model = tiny_model("phi3_longrope")
    rope = model.config.rope_parameters
    path = str(tmp_path / "phi3.gguf")
    write_gguf(path, "phi3", model, PHI3, {"rope_factors_long.weight": np.array(rope["long_factor"], np.float32),
                                           "rope_factors_short.weight": np.array(rope["short_factor"], np.float32)})
    core = check(path, model, lengths, **({"max_model_len": max_model_len} if max_model_len else {}))
    mc = core.runner.model_cfg
    assert (mc.rotary_dim, mc.head_dim, mc.rope_scaling.use_long) == (12, 16, max_model_len is None)


def test_phi3_fused_blocks_stay_quantized(tiny_model, tmp_path, monkeypatch):
    """A Q8_0 attn_qkv and ffn_up are cut into their pieces' rows still in blocks: never expanded
    to floats (not even to learn their shape, which the header gives)."""
    from shardserve.loader.gguf_loader import gguf_sources
    from shardserve.loader.source import LazySource

    _, model = tiny_model("phi3_longrope")
    rope = model.config.rope_parameters
    path = str(tmp_path / "phi3-q8.gguf")
    write_gguf(path, "phi3", model, PHI3, {"rope_factors_long.weight": np.array(rope["long_factor"], np.float32),
                                           "rope_factors_short.weight": np.array(rope["short_factor"], np.float32)},
               quantized=("attn_qkv", "ffn_up"))
    for src in gguf_sources(path, keep_quantized=False):  # the header's shapes are the loaded ones
        assert src._shape is None or src._shape == tuple(src.read().shape), src.name
    expanded, tensor = [], LazySource._tensor
    monkeypatch.setattr(LazySource, "_tensor", lambda self: expanded.append(self.name) or tensor(self))
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(model.config.vocab_size, (n,), generator=g).tolist() for n in (70, 80)]
    tokens, logits, core = run_engine(path, batch, max_num_batched_tokens=2048)
    assert expanded and not [n for n in expanded if "qkv_proj" in n or "gate_up_proj" in n]
    layer = core.runner.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
        assert linear.weight is None and [q.name for _, q in linear.quant] == ["Q8_0x16"]
    for p, lg in zip(batch, logits):
        torch.testing.assert_close(lg, hf_reference(model, p)[1], atol=0.05, rtol=0.05)


def test_rope_tables_refused_in_one_line(tiny_model, tmp_path):
    """A LongRoPE table without its pair, divisors beside stated scaling, a table of the wrong
    length: each a one-line error naming what the file holds."""
    from shardserve.config import ModelConfig
    from shardserve.loader.gguf_metadata import read_gguf_config

    _, model = tiny_model("phi3_longrope")
    long = np.array(model.config.rope_parameters["long_factor"], np.float32)
    path = str(tmp_path / "lone.gguf")
    write_gguf(path, "phi3", model, PHI3, {"rope_factors_long.weight": long})
    with pytest.raises(ValueError, match="rope_factors_long.weight without its pair"):
        read_gguf_config(path)
    _, llama = tiny_model("llama_tied")
    path = str(tmp_path / "short.gguf")
    write_gguf(path, "llama", llama, LLAMA, {"rope_freqs.weight": llama3_rope_freqs(llama.config)[:5]})
    with pytest.raises(ValueError, match=r"rope_freqs \(a GGUF's frequency divisors\) has 5 entries for a rotary "
                                         r"width of 16 \(needs 8\)"):
        ModelConfig.from_dict(read_gguf_config(path))
