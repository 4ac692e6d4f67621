"""`shardserve` command line: serve (the default), chat, bench.

Parsing imports only what flags need; each subcommand imports its own machinery when it runs.
"""

from __future__ import annotations

import argparse
import logging
import sys

from shardserve.launch import LaunchError
from shardserve.server.args import Parser, add_engine_args, non_negative_float, positive_int


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="shardserve", description="Serve LLMs split across devices.")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server (the default)")
    add_engine_args(serve)
    from shardserve.server.serve_args import add_serve_args

    add_serve_args(serve)
    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    add_engine_args(chat)
    chat.add_argument("--max-tokens", type=positive_int, default=256, help="longest reply")
    chat.add_argument("--temperature", type=non_negative_float, default=None,
                      help="(default: the model's generation defaults, else 0 = greedy)")
    bench = sub.add_parser("bench", help="benchmarks")
    from shardserve.bench.cli import add_bench_args

    add_bench_args(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["serve", *argv]
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command in ("chat", "bench") and getattr(args, "node_rank", 0) > 0:
            from shardserve.llm import LLM
            from shardserve.server.args import llm_kwargs

            return LLM(**llm_kwargs(args)).exit_code  # another machine's ranks, until node 0 stops
        if args.command == "serve":
            from shardserve.ipc.child import fast_exit
            from shardserve.server.launch import serve

            fast_exit(serve(args))  # every worker is stopped by now: skip the slow module teardown
        if args.command == "chat":
            from shardserve.server.shell import chat

            return chat(args)
        if args.command == "bench":
            from shardserve.bench.cli import run_bench

            return run_bench(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"shardserve: error: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:
        print(f"shardserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
