"""A GGUF's MoE experts kept in their blocks (--quantization auto), against the expanded model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_util import record_logits
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import quantize
from gguf_util import finish, gguf_writer

from shardserve.config import EngineConfig
from shardserve.layers.moe import SparseMoE
from shardserve.sampling_params import SamplingParams
from shardserve.scheduler.engine_core import EngineCore

LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
         "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"}
# Stacked experts in three formats, as llama.cpp's mixed quantizations store them.
EXPERTS = {"ffn_gate_exps": ("gate_proj", T.Q8_0), "ffn_up_exps": ("up_proj", T.Q4_0),
           "ffn_down_exps": ("down_proj", T.Q4_1)}
PROMPTS = [[5, 9, 2, 77, 3], list(range(20, 60)), [300]]


@pytest.fixture(scope="module")
def tiny_moe_gguf(tiny_model, tmp_path_factory) -> str:
    """The tiny qwen3_moe written as llama.cpp would: float attention, block-quantized experts."""
    _, model = tiny_model("qwen3_moe")
    cfg, sd = model.config, {k: v.numpy() for k, v in model.state_dict().items()}
    path = str(tmp_path_factory.mktemp("moegguf") / "tiny-moe.gguf")
    w = gguf_writer(path, "qwen3moe", cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        for stem, hf in LAYER.items():
            w.add_tensor(f"blk.{i}.{stem}.weight", sd[f"{pre}{hf}.weight"])
        inter, gate_up = cfg.moe_intermediate_size, sd[f"{pre}mlp.experts.gate_up_proj"]  # [experts, 2 inter, hidden]
        stacks = {"gate_proj": gate_up[:, :inter], "up_proj": gate_up[:, inter:],
                  "down_proj": sd[f"{pre}mlp.experts.down_proj"]}
        for stem, (proj, qtype) in EXPERTS.items():
            stack = np.ascontiguousarray(stacks[proj])
            w.add_tensor(f"blk.{i}.{stem}.weight", quantize(stack, qtype), raw_dtype=qtype)
    finish(w)
    return path


def run(path: str, **cfg):
    core = EngineCore(EngineConfig(model=path, show_progress=False, num_pages=64, **cfg))
    seen = record_logits(core)
    reqs = [core.add_request(str(i), p, SamplingParams(max_tokens=8, temperature=0)) for i, p in enumerate(PROMPTS)]
    while core.has_unfinished():
        core.step()
    return [r.output_token_ids for r in reqs], [torch.stack(seen[r.request_id]) for r in reqs], core


def test_moe_experts_stay_in_their_blocks(tiny_moe_gguf):
    tokens, logits, core = run(tiny_moe_gguf)
    moes = [m for m in core.runner.model.modules() if isinstance(m, SparseMoE)]
    assert moes and all(m.quant and m.w13 is None and m.w2 is None and not m.packed for m in moes)
    assert [[q.name for _, q in gu] + [q.name for _, q in down] for gu, down in moes[0].quant[:1]] == \
        [["Q8_0x16", "Q4_0x16", "Q4_1x16"]]  # held in the kernels' x16 layout
    held = sum(q.nbytes for m in moes for gu, down in m.quant for _, q in gu + down)
    in_file = sum(int(t.n_bytes) for t in GGUFReader(tiny_moe_gguf).tensors if "_exps" in t.name)
    assert held == in_file  # the experts' bytes in memory are the file's blocks
    want_tokens, want_logits, expanded = run(tiny_moe_gguf, quantization="none")
    assert not any(m.quant for m in expanded.runner.model.modules() if isinstance(m, SparseMoE))
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):  # the kernels' 16-bit activations
        assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())
