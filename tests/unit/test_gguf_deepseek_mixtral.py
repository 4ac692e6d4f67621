"""GGUF's deepseek2 architecture round trip: the tiny DeepSeek-V3 and V2 written as llama.cpp's
converter lays them out (V3 the current way: MLA key lengths and kv_b_proj split into a
transposed k_b and v_b; V2 the older way: per-head key lengths and kv_b whole), read back by the
engine: greedy tokens equal to transformers', logits within 1e-4. And Mixtral, which llama.cpp
writes as `llama` with stacked experts."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from gguf_util import finish, gguf_writer, llama_cpp_permute
from test_equivalence import hf_reference, prompts, run_engine

from shardserve.config import ModelConfig
from shardserve.loader.gguf_metadata import read_gguf_config

LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
         "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
         "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
         "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj"}


def write_deepseek2(model, path: str, split_kv_b: bool) -> None:
    cfg, sd = model.config, {k: v.numpy() for k, v in model.state_dict().items()}
    # Split kv_b: multi-query attention over the latent (one KV head), per-head sizes apart.
    w = gguf_writer(path, "deepseek2", cfg, kv_heads=1 if split_kv_b else None)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    if split_kv_b:
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
    else:
        w.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.v_head_dim)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    sigmoid = cfg.model_type == "deepseek_v3"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    rope = cfg.rope_parameters
    if rope.get("rope_type", "default") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    h, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        for stem, hf in LAYER.items():
            if f"{pre}{hf}.weight" in sd:
                w.add_tensor(f"blk.{i}.{stem}.weight", sd[f"{pre}{hf}.weight"])
        kv_b = sd[f"{pre}self_attn.kv_b_proj.weight"]
        if split_kv_b:
            per_head = kv_b.reshape(h, nope + v, -1)
            w.add_tensor(f"blk.{i}.attn_k_b.weight", np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1)))
            w.add_tensor(f"blk.{i}.attn_v_b.weight", np.ascontiguousarray(per_head[:, nope:]))
        else:
            w.add_tensor(f"blk.{i}.attn_kv_b.weight", kv_b)
        if f"{pre}mlp.experts.gate_up_proj" in sd:
            inter, gate_up = cfg.moe_intermediate_size, sd[f"{pre}mlp.experts.gate_up_proj"]
            w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :inter]))
            w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, inter:]))
            w.add_tensor(f"blk.{i}.ffn_down_exps.weight", sd[f"{pre}mlp.experts.down_proj"])
        if f"{pre}mlp.gate.e_score_correction_bias" in sd:
            w.add_tensor(f"blk.{i}.exp_probs_b.bias", sd[f"{pre}mlp.gate.e_score_correction_bias"])
    finish(w)


def assert_round_trip(path: str, hf_path: str, model) -> None:
    """The file reads back as the checkpoint's config, and the engine on it equals transformers."""
    got, want = ModelConfig.from_dict(read_gguf_config(path)), ModelConfig.from_dir(hf_path)
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps)  # GGUF keeps it as float32
    assert dataclasses.replace(got, rms_norm_eps=want.rms_norm_eps) == want
    batch = prompts(model.config.vocab_size)
    tokens, logits, _ = run_engine(path, batch)
    for p, toks, lg in zip(batch, tokens, logits):
        ref_tokens, ref_logits = hf_reference(model, p)
        assert toks == ref_tokens
        torch.testing.assert_close(lg, ref_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch,split", [("deepseek_v3", True), ("deepseek_v2", False)])
def test_deepseek2_gguf_matches_transformers(tiny_model, tmp_path, arch, split):
    hf_path, model = tiny_model(arch)
    path = str(tmp_path / f"{arch}.gguf")
    write_deepseek2(model, path, split)
    assert_round_trip(path, hf_path, model)


def test_mixtral_gguf_matches_transformers(tiny_model, tmp_path):
    """llama.cpp writes Mixtral as `llama` with stacked experts (and q/k rows permuted)."""
    hf_path, model = tiny_model("mixtral")
    cfg, sd = model.config, {k: v.numpy() for k, v in model.state_dict().items()}
    path = str(tmp_path / "mixtral.gguf")
    w = gguf_writer(path, "llama", cfg)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[f"{pre}input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[f"{pre}post_attention_layernorm.weight"])
        q, k = sd[f"{pre}self_attn.q_proj.weight"], sd[f"{pre}self_attn.k_proj.weight"]
        w.add_tensor(f"blk.{i}.attn_q.weight", llama_cpp_permute(q, cfg.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", llama_cpp_permute(k, cfg.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[f"{pre}self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[f"{pre}self_attn.o_proj.weight"])
        moe = f"{pre}mlp."  # (in memory; the saved file says block_sparse_moe)
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", sd[f"{moe}gate.weight"])
        inter, gate_up = cfg.intermediate_size, sd[f"{moe}experts.gate_up_proj"]
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :inter]))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, inter:]))
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", sd[f"{moe}experts.down_proj"])
    finish(w)
    assert_round_trip(path, hf_path, model)
