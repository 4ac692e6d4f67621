"""What benchmarks share: a random model written to disk and a timed run's counts (`bench dist`),
and how a run's sampling is named in its printout (`bench offline`, `bench serve`)."""

from __future__ import annotations

import argparse


def random_model(args: argparse.Namespace, path: str) -> None:
    import torch  # here, not at the top: the CLI reads dist.py's shapes (which imports this) to build its parser
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=4096,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)


def per_group(after: dict, before: dict) -> dict:
    return {kind: minus(ops, before["groups"].get(kind, {})) for kind, ops in after["groups"].items()}


def minus(after: dict, before: dict) -> dict:
    """Counts of the timed run alone (the warm-up's subtracted)."""
    out = {}
    for op, rec in after.items():
        base = before.get(op, {"calls": 0, "MB": 0.0})
        out[op] = {"calls": rec["calls"] - base["calls"], "MB": round(rec["MB"] - base["MB"], 6)}
    return out


def sampling_text(sampling: dict | None) -> str:
    """"greedy", or the sampling flags' fields as a run applies them ("temperature 0.7, top_p 0.9")."""
    sampling = sampling or {"temperature": 0.0}
    return "greedy" if not sampling["temperature"] else ", ".join(f"{k} {v}" for k, v in sampling.items())
