"""Tiny random models from transformers' config classes, for conftest's fixtures and the tests
that build one of their own (importable by name, unlike conftest: pytest finds several)."""

from __future__ import annotations

import torch
from tiny_tokenizer import save_tiny_tokenizer
from transformers import AutoModelForCausalLM

# Small enough to run in milliseconds, odd enough to catch shape bugs: vocab 301 divides by
# neither 2, 3 nor 4, and there are fewer KV heads (2) than the largest TP size we test.
COMMON = dict(vocab_size=301, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
              pad_token_id=None)

# Gemma 3's two layer kinds in turn: a 16-token window with a local base of 1000, full attention with
# linear scaling (the 4B-27B's); queries scaled by 24 ** -0.5, not by the head's 16.
GEMMA3 = dict(intermediate_size=96, head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
              sliding_window_pattern=2,
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})

# Gemma 2: a 16-token window on every other layer, scores capped at 5 and logits at 3 (tight, so
# the caps bind on these widened random weights), queries scaled by 24 ** -0.5.
GEMMA2 = dict(intermediate_size=96, head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
              attn_logit_softcapping=5.0, final_logit_softcapping=3.0)


def make_tiny_config(cfg, path: str) -> torch.nn.Module:
    """A random model of transformers config `cfg`, its weights widened (below), saved to `path`
    with the tiny tokenizer."""
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # Random init gives near-uniform logits and fragile argmaxes; widen them so greedy ties
    # cannot flip between two correct fp32 implementations.
    norms = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and p.dim() > 1:
                p.mul_(4.0)
            elif "norm" in name and not p.any():  # Gemma's (1 + w) norms start at w = 0: give w a value
                p.copy_(torch.randn(p.shape, generator=norms) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero as initialised: give it a say in the choice
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    model.save_pretrained(path)
    save_tiny_tokenizer(path, model.config.vocab_size)
    return model
