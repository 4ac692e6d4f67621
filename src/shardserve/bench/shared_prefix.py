"""`shardserve bench serve --workload shared-prefix`: what a router's policy does to the prefix cache.

G groups of requests, each group sharing a long system prompt (`--prefix-words`) followed by its
own question (`--suffix-words`), arrive interleaved in a seeded random order (equal group sizes;
not request i -> group i mod G, which round-robin over an even number of replicas would keep
together by accident). Per run:
the prefix-cache hit rate from the responses' usage (cached prompt tokens over prompt tokens)
beside the ideal one (every group's shared tokens prefilled once: the longest common token prefix
with an earlier request of the group, found with the server's /tokenize), TTFT mean and p90,
output tokens/s, and load balance (max over mean of the prompt tokens each replica or worker was
sent, from the server's or router's /metrics).

Against one URL (`--url`), or side by side in one run: `--spawn "serve flags"` starts a server
per policy in `--policies` (adding `--load-balance-method P`); `--spawn-router "serve flags"`
starts `--router-workers` servers and a `shardserve router --policy P` in front of them, per
policy. Every run starts fresh, so no policy inherits another's cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex

import httpx

from shardserve.bench.serve import WORDS, BenchRequest, base_url, run_requests, stats_ms
from shardserve.router.policy import POLICIES

PROMPT_METRIC = re.compile(r'^\w+_routed_prompt_tokens\{\w+="([^"]+)"\} (\S+)$', re.M)


def check_args(args: argparse.Namespace) -> None:
    where = [f for f, v in (("--url", args.url), ("--spawn", args.spawn), ("--spawn-router", args.spawn_router))
             if v is not None]
    if len(where) != 1:
        raise SystemExit("shardserve bench serve: give exactly one of --url, --spawn, --spawn-router "
                         f"(got {', '.join(where) or 'none'})")
    bad = set(args.policies.split(",")) - set(POLICIES)
    if bad:
        raise SystemExit(f"shardserve bench serve: unknown --policies {','.join(sorted(bad))}")
    if args.url is not None and args.policies != ",".join(POLICIES):
        raise SystemExit("shardserve bench serve: --policies needs --spawn or --spawn-router (a --url server "
                         "has its own)")


def make_requests(args: argparse.Namespace) -> tuple[list[BenchRequest], list[int]]:
    """The requests in arrival order and each one's group."""
    rng = random.Random(args.seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(args.prefix_words)) for _ in range(args.num_groups)]
    groups = [i % args.num_groups for i in range(args.num_requests)]
    rng.shuffle(groups)
    reqs = []
    for g in groups:
        question = " ".join(rng.choice(WORDS) for _ in range(args.suffix_words))
        reqs.append(BenchRequest(f"{prefixes[g]}\n{question}", rng.randint(args.min_output, args.max_output)))
    return reqs, groups


def ideal_cached(url: str, reqs: list[BenchRequest], groups: list[int], endpoint: str) -> int | None:
    """Prompt tokens a perfect router would serve from cache (None: the server has no /tokenize).
    Not rounded down to the server's page size, which it cannot see: a real cache reaches a bit
    less than this."""
    seen: dict[int, list[list[int]]] = {}
    total = 0
    try:
        for req, g in zip(reqs, groups):
            body = ({"messages": [{"role": "user", "content": req.prompt}]} if endpoint == "chat"
                    else {"prompt": req.prompt})
            r = httpx.post(url + "/tokenize", json=body, timeout=60)
            r.raise_for_status()
            ids = r.json()["tokens"]
            total += max((_common(ids, o) for o in seen.get(g, [])), default=0)
            seen.setdefault(g, []).append(ids)
    except (httpx.HTTPError, KeyError, ValueError):
        return None
    return total


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) - 1 and a[n] == b[n]:
        n += 1
    return n


def prompt_tokens_by_target(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in PROMPT_METRIC.finditer(text)}


def measure(args: argparse.Namespace, url: str, api_url: str, label: str) -> dict:
    """One run of the workload against `url`; /tokenize is asked of `api_url` (a server)."""
    reqs, groups = make_requests(args)
    ideal = ideal_cached(api_url, reqs, groups, args.endpoint)
    warm = BenchRequest(" ".join(random.Random(-1).choice(WORDS) for _ in range(24)), 4)
    run_args = argparse.Namespace(**{**vars(args), "url": url, "seed": args.seed})
    asyncio.run(run_requests(argparse.Namespace(**{**vars(run_args), "request_rate": float("inf")}), [warm]))
    before = prompt_tokens_by_target(url)
    results, duration, _ = asyncio.run(run_requests(run_args, reqs))
    after = prompt_tokens_by_target(url)
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    sent = [after[k] - before.get(k, 0.0) for k in after]
    return {
        "label": label, "requests": len(ok), "failed": len(results) - len(ok),
        "hit_rate": cached / prompt if prompt else None,
        "ideal_hit_rate": ideal / prompt if ideal is not None and prompt else None,
        "ttft_ms": stats_ms([r.ttft for r in ok]),
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / duration,
        "imbalance": max(sent) / (sum(sent) / len(sent)) if sent and sum(sent) else None,
        "prompt_tokens_per_target": sent,
    }


def run_shared_prefix(args: argparse.Namespace) -> int:
    from shardserve.bench.spawn import Spawned  # ZeroMQ and process plumbing: not for parsing flags

    runs = []
    policies = args.policies.split(",")
    if args.spawn is None and args.spawn_router is None:
        url = base_url(args.url)
        runs.append(measure(args, url, url, url))
    for policy in policies if args.spawn is not None else []:
        server = Spawned("serve", [*shlex.split(args.spawn), "--load-balance-method", policy], f"serve-{policy}")
        try:
            runs.append(measure(args, server.url, server.url, f"dp server, {policy}"))
        finally:
            server.stop()
    for policy in policies if args.spawn_router is not None else []:
        runs.append(_through_router(args, policy))
    print_runs(runs, args)
    for run in runs:
        print(json.dumps(run))
    return 0 if all(r["requests"] for r in runs) else 1


def _through_router(args: argparse.Namespace, policy: str) -> dict:
    from shardserve.bench.spawn import Spawned

    flags = shlex.split(args.spawn_router)
    model = _flag_value(flags, "--model")
    workers = []
    try:
        for i in range(args.router_workers):
            workers.append(Spawned("serve", flags, f"worker-{i}"))
        router = Spawned("router", ["--worker-urls", *(w.url for w in workers), "--policy", policy,
                                    *(["--model", model] if model else [])], f"router-{policy}")
        try:
            return measure(args, router.url, workers[0].url, f"router + {len(workers)} servers, {policy}")
        finally:
            router.stop()
    finally:
        for w in workers:
            w.stop()


def _flag_value(flags: list[str], name: str) -> str | None:
    """The value of `name` in a command line (`--name X` or `--name=X`): the router's tokenizer."""
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            return flags[i + 1]
        if f.startswith(name + "="):
            return f[len(name) + 1:]
    return None


def print_runs(runs: list[dict], args: argparse.Namespace) -> None:
    print(f"shared-prefix workload: {args.num_requests} requests in {args.num_groups} groups, prefix "
          f"{args.prefix_words} words + {args.suffix_words}-word question, outputs {args.min_output}-"
          f"{args.max_output} tokens, rate {args.request_rate:g}/s, seed {args.seed}")
    print(f"  {'run':<34}{'hit rate':>9}{'ideal':>7}{'of ideal':>9}{'TTFT mean':>10}{'p90':>8}{'out tok/s':>10}"
          f"{'imbalance':>10}{'failed':>7}")
    for r in runs:
        share = r["hit_rate"] / r["ideal_hit_rate"] if r["hit_rate"] is not None and r["ideal_hit_rate"] else None
        cells = [_f(r["hit_rate"]), _f(r["ideal_hit_rate"]), _f(share), _f(r["ttft_ms"]["mean"], 0),
                 _f(r["ttft_ms"]["p90"], 0), _f(r["output_tokens_per_s"], 1), _f(r["imbalance"]), str(r["failed"])]
        print(f"  {r['label']:<34}" + "".join(f"{c:>{w}}" for c, w in zip(cells, (9, 7, 9, 10, 8, 10, 10, 7))))
    base = {r["label"].rsplit(", ", 1)[0]: r for r in runs if r["label"].endswith("round_robin")}
    for r in runs:
        rr = base.get(r["label"].rsplit(", ", 1)[0])
        if r["label"].endswith("cache_aware") and rr is not None and rr["ttft_ms"]["mean"]:
            print(f"  {r['label']}: TTFT mean {r['ttft_ms']['mean'] / rr['ttft_ms']['mean']:.2f}x round_robin's")


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
