"""`shardserve bench {offline,serve,dist,disagg}`: argument parsing and dispatch."""

from __future__ import annotations

import argparse

from shardserve.server.args import add_engine_args, non_negative_int, positive_int, seed_int


def add_bench_args(bench: argparse.ArgumentParser) -> None:
    sub = bench.add_subparsers(dest="bench", required=True)
    from shardserve.bench.dist import add_dist_args

    add_dist_args(sub.add_parser("dist", help="tensor-parallel runs at several sizes, with traffic counts"))
    off = sub.add_parser("offline", help="offline throughput on a fixed random workload")
    add_engine_args(off)
    off.add_argument("--num-requests", type=positive_int, default=64)
    off.add_argument("--min-prompt", type=positive_int, default=32)
    off.add_argument("--max-prompt", type=positive_int, default=512)
    off.add_argument("--min-output", type=positive_int, default=16)
    off.add_argument("--max-output", type=positive_int, default=256)
    off.add_argument("--workload-seed", type=seed_int, default=0)
    off.add_argument("--compare", choices=["transformers", "llama.cpp"], default=None,
                     help="transformers: also run it on the same requests and print the ratio; llama.cpp: one "
                          "stream's prompt and decode tokens/s against llama-bench on the same GGUF")
    off.add_argument("--llama-bench", default=None,
                     help="the llama-bench executable for --compare llama.cpp (default: $LLAMA_BENCH, then PATH)")
    off.add_argument("--hf-batch-size", type=positive_int, default=16,
                     help="static batch size for the transformers peer")
    off.add_argument("--batch1-tokens", type=non_negative_int, default=64,
                     help="also time batch-1 decode of this many tokens (0 = skip)")
    off.add_argument("--json-schema", action="store_true",
                     help="run again with every output held to a JSON schema and print the decode slowdown")
    from shardserve.bench.serve import add_serve_bench_args

    add_serve_bench_args(sub.add_parser("serve", help="load-test an OpenAI-compatible server over HTTP"))
    from shardserve.bench.disagg import add_disagg_args

    add_disagg_args(sub.add_parser("disagg", help="1 prefill + 1 decode instance vs one colocated server, mixed "
                                                  "workload"))


def run_bench(args: argparse.Namespace) -> int:
    if args.bench == "offline":
        from shardserve.bench.offline import run_offline

        return run_offline(args)
    if args.bench == "serve":
        from shardserve.bench.serve import run_serve_bench

        return run_serve_bench(args)
    if args.bench == "disagg":
        from shardserve.bench.disagg import run_disagg

        return run_disagg(args)
    if args.bench == "dist":
        from shardserve.bench.dist import run_dist

        return run_dist(args)
    raise SystemExit(f"unknown benchmark {args.bench!r}")
