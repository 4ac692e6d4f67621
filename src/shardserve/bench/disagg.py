"""`shardserve bench disagg`: one prefill + one decode instance behind the PD router against one
colocated server with the same CPU threads in all, on a mixed workload, side by side.

Workload (the same for both): `--streams` requests with short prompts stream `--stream-tokens`
tokens each from the start, while `--long-prompts` long prompts (`--long-words` words, 16 tokens
asked) arrive one every `--long-every` seconds. A colocated server's prefill chunks share steps
with the streams' decodes, so the streams stall while a long prompt is prefilled; disaggregated,
the decode instance never prefills, but each prompt's KV must cross over, and each instance has
half the threads. We report the streams' inter-token latency, the long prompts' TTFT, output
tokens/s, and from the prefill instance's /metrics the KV bytes shipped against the arithmetic
(layers x 2 x prompt tokens x KV heads x head dim x item size) and how much of it left while the
prefill was still computing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time

import httpx

from shardserve.bench.serve import TIMEOUT, WORDS, send, stats_ms

SECRET_ENV = "SHARDSERVE_DIST_SECRET"


def workload(args: argparse.Namespace) -> list[tuple[float, dict]]:
    """(send time, request body) pairs: the streams at 0, the long prompts spread out after."""
    rng = random.Random(args.seed)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    out = [(0.0, {"prompt": words(24), "max_tokens": args.stream_tokens}) for _ in range(args.streams)]
    out += [(1.0 + i * args.long_every, {"prompt": words(args.long_words), "max_tokens": 16})
            for i in range(args.long_prompts)]
    return out


async def run_workload(url: str, reqs: list[tuple[float, dict]]) -> tuple[list, float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
        start = time.perf_counter()

        async def one(at: float, body: dict):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            body = {**body, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            return await send(client, url, body, "completions")

        results = await asyncio.gather(*(one(at, body) for at, body in reqs))
        return list(results), time.perf_counter() - start


def summarize(results: list, streams: int, duration: float) -> dict:
    ok = [r for r in results if r.ok]
    s, long = results[:streams], results[streams:]
    return {"failed": len(results) - len(ok), "duration_s": duration,
            "output_tokens_per_s": sum(r.output_tokens for r in ok) / duration,
            "stream_itl_ms": stats_ms([x for r in s if r.ok for x in r.itls]),
            "long_ttft_ms": stats_ms([r.ttft for r in long if r.ok]),
            "stream_ttft_ms": stats_ms([r.ttft for r in s if r.ok]),
            "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
            "errors": sorted({r.error for r in results if not r.ok})[:3]}


def transfer_metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.labels["field"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "shardserve_kv_transfer"}


def bytes_per_token(model: str | None) -> int:
    import torch

    from shardserve.loader.model_path import resolve_checkpoint
    from shardserve.loader.weights import read_model_config

    mc = read_model_config(resolve_checkpoint(model))
    return mc.kv_values_per_token(mc.num_kv_heads, mc.num_layers) * torch.empty((), dtype=torch.float32).element_size()


def colocated(args: argparse.Namespace, common: list[str], reqs) -> dict:
    from shardserve.bench.spawn import Spawned, environ  # ZeroMQ and the process tree: not for parsing the flags

    with environ(OMP_NUM_THREADS=str(args.threads)):
        server = Spawned("serve", common, "colocated")
    try:
        results, duration = asyncio.run(run_workload(server.url, reqs))
    finally:
        server.stop()
    return summarize(results, args.streams, duration)


def disaggregated(args: argparse.Namespace, common: list[str], reqs) -> dict:
    from shardserve.bench.spawn import Spawned, environ

    half = str(max(1, args.threads // 2))
    procs = []
    try:
        with environ(OMP_NUM_THREADS=half, **{SECRET_ENV: os.environ.get(SECRET_ENV) or os.urandom(16).hex()}):
            procs.append(Spawned("serve", [*common, "--disaggregation-mode", "prefill"], "prefill"))
            procs.append(Spawned("serve", [*common, "--disaggregation-mode", "decode"], "decode"))
        p, d = procs
        procs.append(Spawned("router", ["--prefill", p.url, "--decode", d.url, "--health-interval", "0.5"], "router"))
        before = transfer_metrics(p.url)
        results, duration = asyncio.run(run_workload(procs[2].url, reqs))
        time.sleep(1.0)  # the prefill instance's last transfer counts reach its /metrics
        after = transfer_metrics(p.url)
    finally:
        for proc in reversed(procs):
            proc.stop()
    out = summarize(results, args.streams, duration)
    moved = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    expected = bytes_per_token(args.model) * out["prompt_tokens"]
    out["transfer"] = {**moved, "expected_bytes": expected,
                       "bytes_per_request": moved.get("bytes", 0) / max(1, moved.get("requests", 1)),
                       "overlapped_fraction": moved.get("early_bytes", 0) / max(1, moved.get("bytes", 1))}
    return out


def run_disagg(args: argparse.Namespace) -> int:
    common = ["--num-pages", str(args.num_pages), "--num-tokenizers", "0", "--max-num-batched-tokens",
              str(args.max_num_batched_tokens)] + (["--model", args.model] if args.model else [])
    reqs = workload(args)
    print(f"[bench] {args.streams} streams x {args.stream_tokens} tokens, {args.long_prompts} prompts of "
          f"{args.long_words} words every {args.long_every:g} s; {args.threads} threads in all; prefill chunks of "
          f"{args.max_num_batched_tokens} tokens", flush=True)
    results = {"colocated": colocated(args, common, reqs), "disaggregated": disaggregated(args, common, reqs)}
    print_table(results)
    print(json.dumps(results))
    return 0 if not any(r["failed"] for r in results.values()) else 1


def print_table(r: dict) -> None:
    c, d = r["colocated"], r["disaggregated"]

    def row(label: str, a, b) -> None:
        ratio = f"{b / a:.2f}x" if isinstance(a, int | float) and a else "-"
        print(f"  {label:<28}{a:>12.1f}{b:>12.1f}{ratio:>10}")

    print(f"  {'':<28}{'colocated':>12}{'1P + 1D':>12}{'PD/colo':>10}")
    row("output tokens/s", c["output_tokens_per_s"], d["output_tokens_per_s"])
    for q in ("p50", "p90", "p99"):
        row(f"stream ITL {q} (ms)", c["stream_itl_ms"][q] or 0, d["stream_itl_ms"][q] or 0)
    for q in ("p50", "p90"):
        row(f"long-prompt TTFT {q} (ms)", c["long_ttft_ms"][q] or 0, d["long_ttft_ms"][q] or 0)
        row(f"stream TTFT {q} (ms)", c["stream_ttft_ms"][q] or 0, d["stream_ttft_ms"][q] or 0)
    t = d["transfer"]
    print(f"  KV shipped: {t.get('bytes', 0) / 1e6:.1f} MB for {t.get('requests', 0):.0f} requests "
          f"(arithmetic {t['expected_bytes'] / 1e6:.1f} MB), {t['overlapped_fraction']:.0%} of it sent while the "
          f"prefill was computing; layer 0 out before the last layer in {t.get('early_chunks', 0):.0f} of "
          f"{t.get('chunks', 0):.0f} chunks; {t.get('exposed_s', 0):.3f} s of sending after the prefills ended")
