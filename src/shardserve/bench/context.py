"""`shardserve bench dist --mode context`: one long prompt under context parallelism at CP N = 1, 2, 4.

A random Llama of the dist modes' shape (its max_position_embeddings raised so the longest-prompt
search is bounded by the KV pool, not the model) serves one prompt of `--prompt-len` tokens (default
2048), greedy, `--new-tokens` out (default 4), at each N of `--sizes` (default 1,2,4). Every N runs in
scheduler processes with one CPU thread per rank (OMP_NUM_THREADS=1 at N = 1; the launcher gives N > 1
ranks cpu_count // N each, one on a 2-core machine), the prefix cache off and max_num_batched_tokens =
the prompt, so the prefill is one chunk, and the same KV pool per rank at every N: the pages the
request needs at N = 1. One JSON line per N, then a summary line:

- `same_tokens`: the greedy tokens equal N = 1's.
- `ring_bytes_per_layer`: each rank's bytes on the context group's op "ring" over the request
  (measured from the rank reports, divided by the layers), beside `expected_ring_bytes_per_layer`:
  (N - 1) x the rank's own block, its keys' K and V in the model dtype plus 8 bytes of position per
  key. Which pages (so how many keys) a rank holds follows from a fresh PageAllocator(parts=N) at the
  same page size, as the engine lays out a first chunk (the last page may be partial).
  `forwarded_ring_bytes_per_layer`: what a ring hop really sends, the block a rank holds at that hop
  (its own, then its predecessors'); the two agree when the blocks are equal.
- `work_max_over_mean`: per-rank causal attention work (unmasked query-key pairs of the rank's
  query positions against keys 0..L-1) max over mean, for the engine's page-grain zigzag layout,
  against `work_max_over_mean_contiguous` (N contiguous slices of the prompt).
- `longest_prompt`: the longest prompt `llm.limits` accepts with the bench's max_tokens (length + 1
  is refused, `refusal` says why); it grows about N times.
- `prefill_seconds` (N = 1 and 2): time to first token of the long prompt, median of 3 runs after
  the greedy run (the warm-up); the summary gives N = 2 over N = 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from shardserve.attention.ring import causal_pairs
from shardserve.bench.runs import per_group, random_model
from shardserve.bench.spawn import environ
from shardserve.kvcache.pages import PageAllocator
from shardserve.sampling_params import SamplingParams
from shardserve.scheduler.limits import RequestLimits

POS_BYTES = 8  # int64 position per key sent with each ring block
TIMED = (1, 2)  # the sizes whose prefill is timed
REPEATS = 3


def page_owners(length: int, page_size: int, ranks: int, pages_per_rank: int) -> list[int]:
    """The context rank holding each page of a one-chunk prefill of `length` tokens on fresh pools."""
    alloc = PageAllocator(pages_per_rank * ranks, page_size, prefix_cache=False, parts=ranks)
    pages = alloc.grow([], -(-length // page_size))
    assert pages is not None, "the prompt does not fit the pools"
    return [alloc.part_of(p) for p in pages]


def positions_by_rank(owners: list[int], length: int, page_size: int) -> list[torch.Tensor]:
    pos = torch.arange(length)
    owner = torch.tensor(owners)[pos // page_size]
    return [pos[owner == r] for r in range(max(owners) + 1)]


def work_ratio(queries: list[torch.Tensor], length: int) -> float:
    """max / mean over ranks of the unmasked (query, key) pairs against keys 0..length-1."""
    keys = torch.arange(length)
    work = [causal_pairs(q, keys) for q in queries]
    return round(max(work) * len(work) / sum(work), 4)


def longest_prompt(limits: RequestLimits, max_tokens: int) -> tuple[int, str]:
    """The longest prompt `limits` accepts with `max_tokens`, and why one token more is refused."""
    params = SamplingParams(max_tokens=max_tokens)

    def refusal(n: int) -> str | None:
        try:
            limits.check([0] * n, params)
        except ValueError as e:
            return str(e)
        return None

    lo, hi = 0, limits.max_model_len + 1  # lo fits (or is 0), hi is refused
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if refusal(mid) is None else (lo, mid)
    why = refusal(lo + 1)
    assert why is not None and (lo == 0 or refusal(lo) is None)
    return lo, why


def run_size(path: str, size: int, args: argparse.Namespace, prompt: list[int], pages: int) -> dict:
    from shardserve.llm import LLM

    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    with environ(OMP_NUM_THREADS="1"):  # the launcher overrides it for N > 1
        llm = LLM(path, cp_size=size, isolated=True, dtype=args.dtype, page_size=args.page_size, num_pages=pages,
                  enable_prefix_cache=False, max_num_batched_tokens=args.prompt_len, show_progress=False)
    with llm:
        llm.generate([[1] * args.page_size * 2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        before, steps = llm.rank_reports(), llm.stats().steps
        tokens = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
        after, steps = llm.rank_reports(), llm.stats().steps - steps
        runs = []
        for _ in range(REPEATS if size in TIMED else 0):
            start = time.perf_counter()
            llm.generate([prompt], first, use_tqdm=False)
            runs.append(round(time.perf_counter() - start, 3))
        limits = llm.limits
    groups = [per_group(a, b).get("context", {}).get("ring", {"calls": 0, "MB": 0.0}) for a, b in zip(after, before)]
    return {"tokens": list(tokens), "steps": steps, "ring": groups, "limits": limits, "runs": runs}


def model_shape(path: str) -> tuple[int, int]:
    """(layers, values of one token's ring block per layer: K and V of every KV head; latent
    attention's one cached vector, which travels once)."""
    from shardserve.model_config import ModelConfig

    mc = ModelConfig.from_dir(path)
    return mc.num_layers, mc.kv_values_per_token(mc.num_kv_heads, 1)


def run_context(args: argparse.Namespace) -> int:
    length, p, sizes = args.prompt_len, args.page_size, args.sizes
    pages = -(-(length + args.new_tokens) // p)  # per rank at every N: what the request needs at N = 1
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or os.path.join(tmp, "model")
        if args.model is None:
            random_model(args, path)
            with open(os.path.join(path, "config.json")) as f:
                cfg = json.load(f)
            cfg["max_position_embeddings"] = max(sizes) * pages * p + p  # longer than any N's pools hold
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(cfg, f)
        layers, values = model_shape(path)
        key_bytes = values * itemsize + POS_BYTES
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(args.vocab if args.model is None else 1000, (length,), generator=g).tolist()
        first, lines = None, []
        for n in sizes:
            run = run_size(path, n, args, prompt, pages)
            first = first if first is not None else run["tokens"]
            queries = positions_by_rank(page_owners(length, p, n, pages), length, p)
            blocks = [len(q) * key_bytes for q in queries]
            totals = [round(r["MB"] * 1e6) for r in run["ring"]]  # MB are 10^6 bytes to 6 decimals: exact
            measured = [t // layers if t % layers == 0 else t / layers for t in totals]
            expected = [(n - 1) * b for b in blocks]
            forwarded = [sum(blocks[(r - h) % n] for h in range(n - 1)) for r in range(n)]
            longest, why = longest_prompt(run["limits"], args.new_tokens)
            prefill = statistics.median(run["runs"]) if run["runs"] else None
            line = {"mode": "context", "ranks": n, "prompt_len": length, "new_tokens": args.new_tokens,
                    "prefill_one_chunk": run["steps"] == args.new_tokens,  # one prefill step, then decodes
                    "prefix_cache": False, "max_num_batched_tokens": length,
                    "layers": layers, "threads_per_rank": 1 if n == 1 else max(1, (os.cpu_count() or 1) // n),
                    "same_tokens": run["tokens"] == first, "steps": run["steps"], "kv_pages_per_rank": pages,
                    "keys_per_rank": [len(q) for q in queries],
                    "ring_calls_per_rank": [r["calls"] for r in run["ring"]],
                    "ring_bytes_per_layer": measured, "expected_ring_bytes_per_layer": expected,
                    "ring_bytes_match": measured == expected,
                    "forwarded_ring_bytes_per_layer": forwarded, "ring_bytes_match_forwarded": measured == forwarded,
                    "work_max_over_mean": work_ratio(queries, length),
                    "work_max_over_mean_contiguous": work_ratio(list(torch.arange(length).tensor_split(n)), length),
                    "longest_prompt": longest, "refused_at": longest + 1, "refusal": why,
                    "prefill_seconds": prefill, "prefill_runs": run["runs"]}
            lines.append(line)
            print(json.dumps(line), flush=True)
    base, timed = lines[0], {r["ranks"]: r["prefill_seconds"] for r in lines if r["prefill_seconds"] is not None}
    by_size = {key: {r["ranks"]: r[key] for r in lines}
               for key in ("work_max_over_mean", "work_max_over_mean_contiguous", "longest_prompt")}
    print(json.dumps({"mode": "context", "summary": True,
                      "prefill_one_chunk": all(r["prefill_one_chunk"] for r in lines),
                      "same_tokens": all(r["same_tokens"] for r in lines),
                      "ring_bytes_match": all(r["ring_bytes_match"] for r in lines),
                      "ring_bytes_match_forwarded": all(r["ring_bytes_match_forwarded"] for r in lines), **by_size,
                      "longest_over_first": {r["ranks"]: round(r["longest_prompt"] / base["longest_prompt"], 3)
                                             for r in lines},
                      "prefill_seconds": timed,
                      "prefill_n2_over_n1": round(timed[2] / timed[1], 3) if {1, 2} <= timed.keys() else None}),
          flush=True)
    return 0
