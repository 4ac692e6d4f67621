"""`shardserve bench serve`: load-test any OpenAI-compatible server over HTTP.

A fixed, seeded request set (word prompts any tokenizer accepts, greedy, `ignore_eos`) is sent
either all at once or with Poisson arrivals at `--request-rate`; every request streams. Per
request we time TTFT (send -> first non-empty text chunk), the gaps between later text chunks
(ITL) and the end-to-end latency, and count output tokens from the server's usage (or, where the
server reports none, as the number of text chunks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from shardserve.bench.runs import sampling_text

# Common English words: short, so most tokenizers give each one or two tokens.
WORDS = (
    "the of and to in is was for on that with as by at from his her it an are were which be this had not but "
    "what all when we there can one more if out so said up its about into than them time only new some could "
    "these two may first then do any like my now over such our man me even most made after also did many "
    "before must through back years where much your way well down should because each just those people how "
    "too little state good very make world still own see men work long get here between both life being under "
    "never day same another know while last might us great old year off come since against go came right used "
    "take three house city river paris rome capital weather sunny warm hello today thank fine"
).split()
DEFAULT_PROMPT = (32, 256)
DEFAULT_OUTPUT = (16, 128)
TIMEOUT = httpx.Timeout(3600.0, connect=60.0)


@dataclass
class BenchRequest:
    """One request of the workload: a text prompt and the number of tokens it asks for."""

    prompt: str
    output_len: int


@dataclass
class RequestResult:
    """What one request measured; times in seconds."""

    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage's prompt_tokens_details.cached_tokens, where reported
    finish_reason: str | None = None


def resolve_ranges(args: argparse.Namespace) -> None:
    """Fill unset --min-* from the defaults (capped by --max-*) and check every range."""
    if args.min_prompt is None:
        args.min_prompt = min(DEFAULT_PROMPT[0], args.max_prompt)
    if args.min_output is None:
        args.min_output = min(DEFAULT_OUTPUT[0], args.max_output)
    if args.min_prompt > args.max_prompt or args.min_output > args.max_output:
        raise SystemExit("shardserve bench serve: --min-* must not exceed --max-*")
    if not args.request_rate > 0:
        raise SystemExit("shardserve bench serve: --request-rate must be > 0")
    if args.workload != "shared-prefix" and (args.spawn is not None or args.spawn_router is not None):
        raise SystemExit("shardserve bench serve: --spawn and --spawn-router are for --workload shared-prefix")


def make_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """Seeded word prompts and output lengths; the same flags always give the same requests."""
    rng = random.Random(args.seed)
    reqs = []
    for _ in range(args.num_requests):
        n_words = rng.randint(args.min_prompt, args.max_prompt)
        prompt = " ".join(rng.choice(WORDS) for _ in range(n_words))
        reqs.append(BenchRequest(prompt, rng.randint(args.min_output, args.max_output)))
    return reqs


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets (s) from the start: all zero at an infinite rate, else a seeded Poisson process."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def base_url(url: str) -> str:
    """The server root: accepts the URL with or without a trailing /v1."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def first_model(client: httpx.AsyncClient, url: str) -> str:
    """The first model id the server lists."""
    r = await client.get(f"{url}/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def request_body(req: BenchRequest, model: str, endpoint: str, sampling: dict | None = None) -> dict:
    """A streaming request that asks for exactly `output_len` tokens, greedy unless `sampling`
    (temperature, top_p, top_k, min_p) says otherwise."""
    body = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, **(sampling or {})}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def chunk_text(chunk: dict) -> str:
    """The text a completion or chat chunk carries ('' for usage-only or role chunks)."""
    texts = []
    for choice in chunk.get("choices") or []:
        texts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(texts)


class StreamTimer:
    """Collects chunk timestamps and usage for one request as its SSE stream arrives."""

    def __init__(self, start: float):
        self.start = start
        self.text_times: list[float] = []
        self.first_choice: float | None = None
        self.usage: dict | None = None
        self.finish_reason: str | None = None

    def add(self, chunk: dict, now: float) -> None:
        if "error" in chunk:
            raise RuntimeError(f"error in stream: {chunk['error']}")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if choices and self.first_choice is None:
            self.first_choice = now
        for choice in choices:
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if chunk_text(chunk):
            self.text_times.append(now)

    def result(self, end: float) -> RequestResult:
        times = self.text_times or ([self.first_choice] if self.first_choice is not None else [])
        if not times:
            return RequestResult(error="no output")
        usage = self.usage or {}
        return RequestResult(
            ok=True, ttft=times[0] - self.start, latency=end - self.start,
            itls=[b - a for a, b in zip(times, times[1:])],
            output_tokens=usage.get("completion_tokens") or len(self.text_times),
            prompt_tokens=usage.get("prompt_tokens"), finish_reason=self.finish_reason,
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        )


async def send(client: httpx.AsyncClient, url: str, body: dict, endpoint: str) -> RequestResult:
    """POST one streaming request and time its chunks; any failure becomes a failed result."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    timer = StreamTimer(time.perf_counter())
    try:
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return RequestResult(error=f"HTTP {r.status_code}: {text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                timer.add(json.loads(data), time.perf_counter())
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        return RequestResult(error=f"{type(e).__name__}: {e}")
    return timer.result(time.perf_counter())


async def run_requests(args: argparse.Namespace, reqs: list[BenchRequest]) -> tuple[list[RequestResult], float, str]:
    """Send every request at its arrival time; return the results, the wall time and the model name."""
    url = base_url(args.url)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
        model = args.model_name or await first_model(client, url)
        offsets = arrival_times(len(reqs), args.request_rate, args.seed)
        start = time.perf_counter()

        async def one(req: BenchRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            return await send(client, url, request_body(req, model, args.endpoint, getattr(args, "sampling", None)),
                              args.endpoint)

        results = await asyncio.gather(*(one(r, o) for r, o in zip(reqs, offsets, strict=True)))
        return list(results), time.perf_counter() - start, model


def stats_ms(values: list[float]) -> dict[str, float | None]:
    """Mean and p50/p90/p99 (linear interpolation) of seconds, in milliseconds; None when empty."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = np.asarray(values) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99]).tolist()
    return {"mean": float(ms.mean()), "p50": p50, "p90": p90, "p99": p99}


def summarize(results: list[RequestResult], reqs: list[BenchRequest], duration: float) -> dict:
    """The final numbers over the successful requests."""
    ok = [r for r in results if r.ok]
    reported = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_tokens_per_s": output_tokens / duration,
        "output_tokens": output_tokens, "requested_output_tokens": sum(r.output_len for r in reqs),
        "prompt_tokens": sum(reported) if len(reported) == len(ok) else None,
        "prompt_words": sum(len(r.prompt.split()) for r in reqs),
        "stopped_early": sum(r.finish_reason not in (None, "length") for r in ok),
        "ttft_ms": stats_ms([r.ttft for r in ok]), "itl_ms": stats_ms([x for r in ok for x in r.itls]),
        "e2e_latency_ms": stats_ms([r.latency for r in ok]),
    }


def fmt(value: float | int | None) -> str:
    """A table cell."""
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def print_table(s: dict, args: argparse.Namespace, model: str, errors: list[str]) -> None:
    """Human-readable summary of `summarize`'s dict."""
    rate = "inf (all at once)" if math.isinf(args.request_rate) else f"{args.request_rate:g}/s Poisson"
    print(f"server {base_url(args.url)}  model {model!r}  endpoint {args.endpoint}  rate {rate}")
    print(f"workload: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt} words, "
          f"outputs {args.min_output}-{args.max_output} tokens, {sampling_text(getattr(args, 'sampling', None))}, "
          f"ignore_eos, seed {args.seed}")
    rows = [("successful requests", s["requests"]), ("failed requests", s["failed"]),
            ("duration (s)", s["duration_s"]), ("request throughput (req/s)", s["request_throughput"]),
            ("output tokens/s", s["output_tokens_per_s"]), ("output tokens (requested)",
                                                            f"{s['output_tokens']} ({s['requested_output_tokens']})"),
            ("prompt tokens (server usage)", s["prompt_tokens"]),
            ("stopped before max_tokens", s["stopped_early"])]
    for label, value in rows:
        print(f"  {label:<30}{fmt(value):>14}")
    print(f"  {'(ms)':<30}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for label, key in [("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("end-to-end latency", "e2e_latency_ms")]:
        print(f"  {label:<30}" + "".join(f"{fmt(s[key][q]):>10}" for q in ("mean", "p50", "p90", "p99")))
    for e in sorted(set(errors))[:5]:
        print(f"  error: {e}")


def run_serve_bench(args: argparse.Namespace) -> int:
    """Run the load test, print a table and one final JSON line; exit 1 if every request failed."""
    if args.url is None:
        raise SystemExit("shardserve bench serve: --url is needed")
    reqs = make_requests(args)
    try:
        results, duration, model = asyncio.run(run_requests(args, reqs))
    except httpx.HTTPError as e:
        raise SystemExit(f"shardserve bench serve: cannot reach {args.url}: {e}") from None
    summary = summarize(results, reqs, duration)
    print_table(summary, args, model, [r.error for r in results if not r.ok])
    print(json.dumps(summary))
    return 0 if summary["requests"] else 1
