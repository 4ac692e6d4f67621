"""`shardserve bench`'s dispatch: `run_bench` runs the benchmark the command line names, after its
own checks of the flags, importing that benchmark's machinery (torch, an HTTP client) only then.
"""

from __future__ import annotations

import argparse

from shardserve.cli.bench_flags import sampling_of
from shardserve.cli.flags import llm_kwargs


def run_bench(args: argparse.Namespace) -> int:
    if args.bench in ("offline", "serve"):
        args.sampling = sampling_of(args)
    if args.bench == "offline" and args.dtype == "auto":  # the peers must run in the very dtype ours does
        from shardserve.config import EngineConfig
        from shardserve.loader.model_path import resolve_checkpoint
        from shardserve.loader.weights import resolve_dtype

        args.dtype = resolve_dtype(EngineConfig(model=args.model, device=args.device),
                                   resolve_checkpoint(args.model)).dtype
    if args.bench == "offline" and args.speculative_method:
        from shardserve.bench.speculative import run_speculative_bench

        return run_speculative_bench(args, llm_kwargs(args))
    if args.bench == "offline":
        from shardserve.bench.offline import run_offline

        return run_offline(args, llm_kwargs(args))
    if args.bench == "lora":
        from shardserve.bench.lora import run_lora_bench

        if args.num_requests < max(args.lora_counts):
            raise ValueError(f"--num-requests {args.num_requests} cannot spread over {max(args.lora_counts)} adapters")
        return run_lora_bench(args, llm_kwargs(args))
    if args.bench == "batch1":
        from shardserve.bench.batch1 import run_batch1_bench

        return run_batch1_bench(args, llm_kwargs(args))
    if args.bench == "serve":
        import logging

        from shardserve.bench.serve import resolve_ranges, run_serve_bench

        resolve_ranges(args)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # no log line per request
        if args.workload == "shared-prefix":
            from shardserve.bench.shared_prefix import check_args, run_shared_prefix

            check_args(args)
            return run_shared_prefix(args)
        return run_serve_bench(args)
    if args.bench == "disagg":
        from shardserve.bench.disagg import run_disagg

        return run_disagg(args)
    if args.bench == "dist":
        from shardserve.bench.dist import run_dist

        return run_dist(args)
    if args.bench == "soak":
        import logging

        from shardserve.bench.soak import run_soak

        if (args.spawn is None) == (args.url is None):
            raise SystemExit("shardserve bench soak: error: give one of --spawn SERVE_ARGS or --url URL")
        logging.getLogger("httpx").setLevel(logging.WARNING)
        return run_soak(args)
    raise SystemExit(f"unknown benchmark {args.bench!r}")
