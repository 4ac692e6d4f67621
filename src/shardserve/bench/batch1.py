"""One stream's decode speed on our engine (bench offline, its llama.cpp comparison, bench batch1)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shardserve.llm import LLM
from shardserve.sampling_params import SamplingParams
from shardserve.structured_outputs import StructuredOutputsParams


def batch1_ours(llm: LLM, prompt: list[int], k: int, spec: StructuredOutputsParams | None = None) -> float:
    """Decode tokens/s of one request alone, excluding its first token (the prefill)."""
    t1 = 0.0
    params = SamplingParams(max_tokens=k, temperature=0, ignore_eos=True, structured_outputs=spec)
    for out in llm.stream(prompt, params):
        if not t1 and out.new_ids:
            t1 = time.perf_counter()
    return (k - 1) / (time.perf_counter() - t1)


def run_batch1_bench(args: argparse.Namespace, kwargs: dict) -> int:
    """`shardserve bench batch1`: one stream's decode tokens/s of one checkpoint in each of
    `--dtypes`, every engine built once and the runs alternating over `--rounds`, so that a shared
    machine's drift (its memory bandwidth, which one-stream decode is bound by, moves by tens of
    percent from minute to minute on a virtual machine) touches each alike. Prints each round and
    its ratios to the first dtype, then the medians as JSON."""
    engines: dict[str, LLM] = {}
    try:  # every engine shut down, whichever run fails
        for dtype in args.dtypes:
            engines[dtype] = LLM(**{**kwargs, "dtype": dtype})
        runs = _alternate(args, engines)
    finally:
        for llm in engines.values():
            llm.shutdown()
    ratios = {d: [b / x for b, x in zip(runs[args.dtypes[0]], runs[d])] for d in args.dtypes[1:]}
    result = {"tokens": args.tokens, "prompt_tokens": args.prompt_len, "rounds": args.rounds,
              "decode_tps": {d: statistics.median(v) for d, v in runs.items()},
              f"{args.dtypes[0]}_over": {d: statistics.median(v) for d, v in ratios.items()}}
    print(json.dumps(result))
    return 0


def _alternate(args: argparse.Namespace, engines: dict[str, LLM]) -> dict[str, list[float]]:
    """Each dtype's decode tokens/s per round, the dtypes taking turns; prints each round."""
    g = torch.Generator().manual_seed(args.workload_seed)
    vocab = engines[args.dtypes[0]].limits.vocab_size
    prompt = torch.randint(min(100, vocab // 2), vocab, (args.prompt_len,), generator=g).tolist()
    for llm in engines.values():  # warm-up: kernels built, caches touched
        batch1_ours(llm, prompt, 8)
    runs: dict[str, list[float]] = {d: [] for d in args.dtypes}
    for r in range(args.rounds):
        for dtype, llm in engines.items():
            runs[dtype].append(batch1_ours(llm, prompt, args.tokens))
        base = runs[args.dtypes[0]][-1]
        print(f"round {r + 1}: " + ", ".join(f"{d} {runs[d][-1]:.1f} tok/s" for d in args.dtypes)
              + "".join(f"; {args.dtypes[0]} / {d} {base / runs[d][-1]:.2f}x" for d in args.dtypes[1:]), flush=True)
    return runs
