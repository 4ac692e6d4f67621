"""Flags of `shardserve router`: the standalone HTTP router, plain or prefill/decode."""

from __future__ import annotations

import argparse
import os

from shardserve.cli.flag_types import non_negative_float, non_negative_int, port_number, positive_float, positive_int
from shardserve.logs import LOG_LEVELS
from shardserve.openai_errors import API_KEY_ENV

WORKER_KEY_ENV = "SHARDSERVE_WORKER_API_KEY"


def worker_url(text: str) -> str:
    """An http(s) base URL; without a scheme every request to it would fail at run time instead."""
    if not text.startswith(("http://", "https://")) or len(text.split("://", 1)[1].strip("/")) == 0:
        raise argparse.ArgumentTypeError(f"expected a URL like http://HOST:PORT, got {text!r}")
    return text.rstrip("/")


def router_mode_error(args: argparse.Namespace) -> str | None:
    """Why the `router` flags name no single mode (plain: --worker-urls; PD: --prefill and
    --decode), or None when they name one."""
    plain, prefill, decode = bool(args.worker_urls), bool(args.prefill), bool(args.decode)
    if plain and (prefill or decode):
        return "--worker-urls (plain mode) cannot be combined with --prefill/--decode (prefill/decode mode)"
    if prefill != decode:
        given, missing = ("--prefill", "--decode") if prefill else ("--decode", "--prefill")
        return f"{given} needs {missing} too (prefill/decode mode takes both)"
    if not (plain or prefill):
        return "give --worker-urls URL ... (plain mode), or --prefill URL ... --decode URL ... (prefill/decode mode)"
    return None


def add_router_args(p: argparse.ArgumentParser) -> None:
    from shardserve.router.policy import POLICIES, Thresholds  # plain Python: cheap to import for parsing

    t = Thresholds()
    p.add_argument("--worker-urls", nargs="+", metavar="URL", type=worker_url,
                   help="base URLs of the workers, e.g. http://10.0.0.1:30000 (plain mode)")
    p.add_argument("--prefill", nargs="+", metavar="URL", type=worker_url,
                   help="base URLs of the prefill instances (prefill/decode mode, with --decode)")
    p.add_argument("--decode", nargs="+", metavar="URL", type=worker_url,
                   help="base URLs of the decode instances, picked by least outstanding tokens (with --prefill)")
    # --load-balance-method too: the name `shardserve serve` gives the same choice for its replicas.
    p.add_argument("--policy", "--load-balance-method", dest="policy", choices=POLICIES, default="cache_aware",
                   help="how requests are spread over the workers, or in prefill/decode mode over the prefill "
                        "instances (default: cache_aware)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=30000)
    p.add_argument("--model", default=None,
                   help="checkpoint directory or .gguf whose tokenizer keys the routing (default: characters)")
    p.add_argument("--page-size", type=positive_int, default=16,
                   help="tokens (or characters) per prefix page the policy matches on")
    p.add_argument("--max-tree-pages", type=positive_int, default=65536,
                   help="pages the router remembers per worker, least recently used dropped first")
    p.add_argument("--health-interval", type=positive_float, default=1.0, help="seconds between /health checks")
    p.add_argument("--request-timeout", type=positive_float, default=600.0,
                   help="seconds a worker may stay silent (before its answer, or between stream events); "
                        "then the client gets a 504 (or an error event) and the worker stays in")
    p.add_argument("--balance-abs-tokens", type=non_negative_int, default=t.balance_abs_tokens,
                   help="cache_aware goes to the least loaded worker when loads differ by more than this ...")
    p.add_argument("--balance-rel", type=positive_float, default=t.balance_rel,
                   help="... and the most loaded carries more than this times the least")
    p.add_argument("--load-weight", type=non_negative_float, default=t.load_weight,
                   help="cache_aware score: cached prompt tokens minus this times outstanding tokens")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV, ""),
                   help=f"key clients must send as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    p.add_argument("--worker-api-key", default=os.environ.get(WORKER_KEY_ENV, ""),
                   help=f"key sent to the workers (their --api-key; default: ${WORKER_KEY_ENV})")
    p.add_argument("--metrics-require-key", action="store_true",
                   help="require the key on /health, /ping and /metrics too")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="this process's log level (uvicorn's too)")
    # Which mode the flags name is known only once all are parsed; it is checked then, as a one-line
    # error of this subcommand (argparse hands a subcommand's arguments to its parse_known_args).
    parse_known_args = p.parse_known_args

    def parse_and_check(args=None, namespace=None):
        parsed, extras = parse_known_args(args, namespace)
        if (message := router_mode_error(parsed)) is not None:
            p.error(message)
        return parsed, extras

    p.parse_known_args = parse_and_check
