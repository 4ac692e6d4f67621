"""`shardserve bench dist --mode bubble`: does keeping several micro-batches in flight fill the
pipeline's bubble? PP 2 with 2 micro-batches against PP 2 with 1, and TP 2 beside them.

With one micro-batch in flight each of the two stages idles while the other works, so PP 2 runs
at the speed of one rank; with two, both stages work at once. TP 2 splits every step's work
instead, which also cuts the time of each decode step. Each configuration serves the same
requests (prompts of --prompt-len, outputs of varied lengths, greedy, EOS ignored) on a random
model of the given shape, each rank one CPU thread when the machine has two cores. One JSON line
per configuration: output tokens/s on the batch, and one request's decode latency (ms per
token, from the time of 1 token and of 33); then a summary line with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from shardserve.sampling_params import SamplingParams

CONFIGS = [("pp2_mb1", {"pp_size": 2, "pp_micro_batches": 1}),
           ("pp2_mb2", {"pp_size": 2, "pp_micro_batches": 2}),
           ("tp2", {"tp_size": 2})]
LATENCY_TOKENS = 32


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(args.vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.bubble_requests)]
    low = max(1, args.bubble_max_tokens // 3)
    lengths = torch.randint(low, args.bubble_max_tokens + 1, (args.bubble_requests,), generator=g).tolist()
    return prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]


def measure(path: str, layout: dict, args: argparse.Namespace, prompts, params) -> dict:
    from shardserve.llm import LLM

    with LLM(path, isolated=True, dtype=args.dtype, page_size=args.page_size, kv_cache_memory=args.kv_cache_memory,
             show_progress=False, **layout) as llm:
        llm.generate([[1] * args.page_size * 2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        one = [2] * args.prompt_len
        start = time.perf_counter()
        llm.generate([one], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([[3] * args.prompt_len], SamplingParams(max_tokens=LATENCY_TOKENS + 1, temperature=0,
                                                             ignore_eos=True), use_tqdm=False)
        latency_ms = (time.perf_counter() - start - first) / LATENCY_TOKENS * 1000
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        stats = llm.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    return {"output_tokens": tokens, "seconds": round(seconds, 3), "output_tok_s": round(tokens / seconds, 1),
            "decode_ms_per_token": round(latency_ms, 2), "max_in_flight": stats.max_in_flight,
            "token_ids": [o.token_ids for o in outs]}


def run_bubble(args: argparse.Namespace) -> int:
    from shardserve.bench.runs import random_model

    prompts, params = workload(args)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or os.path.join(tmp, "model")
        if args.model is None:
            random_model(args, path)
        for name, layout in CONFIGS:
            results[name] = measure(path, layout, args, prompts, params)
    first = results["pp2_mb1"].pop("token_ids")
    for name, _ in CONFIGS:
        r = results[name]
        same = r.pop("token_ids", first) == first
        print(json.dumps({"mode": "bubble", "config": name, "requests": len(prompts), "same_tokens": same, **r}),
              flush=True)
    tput = {name: r["output_tok_s"] for name, r in results.items()}
    print(json.dumps({"mode": "bubble", "summary": True,
                      "pp2_mb2_over_mb1_throughput": round(tput["pp2_mb2"] / tput["pp2_mb1"], 2),
                      "tp2_over_pp2_mb2_throughput": round(tput["tp2"] / tput["pp2_mb2"], 2),
                      "decode_ms_per_token": {n: r["decode_ms_per_token"] for n, r in results.items()}}), flush=True)
    return 0
