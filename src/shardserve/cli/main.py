"""`shardserve` command line: serve (the default), chat, bench, router, record-experts, env.

Parsing imports only what flags need; each subcommand imports its own machinery when it runs.
"""

from __future__ import annotations

import argparse
import logging
import sys

from shardserve.cli.flag_types import Parser, non_negative_float, positive_int
from shardserve.cli.flags import add_engine_args
from shardserve.cli.router_flags import add_router_args
from shardserve.launch import LaunchError
from shardserve.logs import use_log_level


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="shardserve", description="Serve LLMs split across devices.")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server (the default)")
    add_engine_args(serve)
    from shardserve.cli.serve_flags import add_serve_args

    add_serve_args(serve)
    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    add_engine_args(chat)
    chat.add_argument("--max-tokens", type=positive_int, default=256, help="longest reply")
    chat.add_argument("--temperature", type=non_negative_float, default=None,
                      help="sampling temperature, 0 = greedy (default: the model's generation defaults, else 0)")
    bench = sub.add_parser("bench", help="benchmarks")
    from shardserve.cli.bench_flags import add_bench_args

    add_bench_args(bench)
    add_router_args(sub.add_parser("router", help="HTTP router in front of OpenAI-compatible servers"))
    from shardserve.cli.record_experts import add_record_args

    add_record_args(sub.add_parser("record-experts", help="write a MoE model's routing counts (for "
                                                          "--ep-expert-placement)"))
    from shardserve.cli.env import add_env_args

    add_env_args(sub.add_parser("env", help="versions, CPU instruction sets, C kernels, threads and devices "
                                            "(for a bug report)"))
    return parser


def set_log_level(level: str) -> None:
    """--log-level for this process (its libraries too: uvicorn, httpx) and every child's."""
    use_log_level(level)
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["serve", *argv]
    args = parser.parse_args(argv)
    set_log_level(getattr(args, "log_level", "info"))
    try:
        if args.command in ("chat", "bench", "record-experts") and getattr(args, "node_rank", 0) > 0:
            from shardserve.cli.flags import llm_kwargs
            from shardserve.llm import LLM

            return LLM(**llm_kwargs(args)).exit_code  # another machine's ranks, until node 0 stops
        if args.command == "serve":
            from shardserve.cli.flags import deployment
            from shardserve.cli.serve_flags import disaggregation_config
            from shardserve.ipc.child import fast_exit
            from shardserve.server.launch import serve

            # every worker is stopped by now: skip the slow module teardown
            fast_exit(serve(args, deployment(args, **disaggregation_config(args))))
        if args.command == "chat":
            from shardserve.cli.flags import llm_kwargs
            from shardserve.server.shell import chat

            return chat(llm_kwargs(args), args.max_tokens, args.temperature)
        if args.command == "bench":
            from shardserve.cli.bench_run import run_bench

            return run_bench(args)
        if args.command == "record-experts":
            from shardserve.cli.record_experts import record_experts

            return record_experts(args)
        if args.command == "env":
            from shardserve.cli.env import run_env

            return run_env(args)
        if args.command == "router":
            from shardserve.gateway.standalone import run_router

            return run_router(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"shardserve: error: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:
        print(f"shardserve: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
