"""`shardserve bench dist`: the same workload at several sizes of one layout, with traffic.

`--mode tensor` varies --tp-size, `--mode pipeline` varies --pp-size (`--sizes`). One JSON line per
run: mode, ranks, same_tokens (equal to the first run's), steps (micro-batches under pipeline
parallelism), kv_pages_per_rank, seconds, rank 0's counts on the tensor-parallel group
(`traffic`), on the pipeline group (`pipeline`) and on the control group (`control`: what keeps
the ranks' schedules in agreement), every rank's counts on every group it belongs to
(`traffic_per_rank`: a list by rank of {kind: {op: {calls, MB}}}), MB = 10^6 bytes, and each
rank's peak memory while loading. All requests are admitted before the first step, so the step
and call counts are the same every run. `--mode bubble` is the pipeline's throughput benchmark
(bench/bubble.py); `--mode expert` is expert parallelism under data-parallel attention beside
tensor parallelism, with hot-expert replicas (bench/expert.py); `--mode latent` is a DeepSeek-shaped
model's latent cache under TP against data-parallel attention (bench/latent.py); `--mode context` is
context parallelism on one long prompt: tokens, ring bytes, per-rank attention work, longest prompt, prefill time
(bench/context.py).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from shardserve.bench.runs import minus, per_group, random_model
from shardserve.sampling_params import SamplingParams

# The traffic modes' default model is small (the counts follow from the shapes); the bubble's is
# large enough that a half-size micro-batch costs about half a full one on a CPU (see bubble.py).
_BASE = dict(layers=4, hidden=512, heads=8, kv_heads=4, intermediate=1536, vocab=1024, num_prompts=8,
             prompt_len=64, new_tokens=16)
SHAPES = {"tensor": _BASE, "pipeline": _BASE, "expert": _BASE, "latent": _BASE,
          "context": _BASE | dict(num_prompts=1, prompt_len=2048, new_tokens=4),
          "bubble": _BASE | dict(layers=8, hidden=1024, heads=16, intermediate=4096, prompt_len=128)}


def fill_defaults(args: argparse.Namespace) -> None:
    """Give every shape flag left out its mode's default."""
    for flag, value in SHAPES[args.mode].items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    if args.kv_cache_memory is None:
        # latent: small enough that one pool cannot hold the whole workload (the point of that mode)
        args.kv_cache_memory = {"bubble": 512, "latent": 1}.get(args.mode, 64) * 2**20


def one_run(path: str, size: int, args: argparse.Namespace, prompts: list[list[int]]) -> tuple[dict, list]:
    from shardserve.llm import LLM

    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    layout = {"tp_size": size} if args.mode == "tensor" else {"pp_size": size}
    # isolated: every size runs in scheduler processes, so timings and memory compare fairly.
    with LLM(path, **layout, isolated=True, dtype=args.dtype, page_size=args.page_size,
             kv_cache_memory=args.kv_cache_memory, show_progress=False,
             pp_micro_batches=args.pp_micro_batches if args.mode == "pipeline" and size > 1 else None) as llm:
        # Warm-up (untimed) on a prompt that shares no page with the workload.
        llm.generate([[1] * args.page_size * 2], SamplingParams(max_tokens=2), use_tqdm=False)
        warm, warm_ranks = llm.stats(), llm.rank_reports()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        stats, ranks = llm.stats(), llm.rank_reports()
        pages = llm.limits.num_pages
        infos = [llm.worker_info[f"scheduler-{r}"] for r in range(size)]
    tokens = [o.token_ids for o in outs]
    per_rank = [per_group(after, before) for after, before in zip(ranks, warm_ranks)]
    return {"mode": args.mode, "ranks": size, "steps": stats.steps - warm.steps, "kv_pages_per_rank": pages,
            "seconds": round(seconds, 3), "traffic": minus(stats.traffic, warm.traffic),
            "pipeline": per_rank[0].get("pipeline", {}), "control": per_rank[0].get("control", {}),
            "traffic_per_rank": per_rank,
            "layers_per_rank": [i["layers"] for i in infos],
            "peak_load_rss_mb": [i["peak_load_rss_mb"] for i in infos],
            "anon_rss_mb_after_load": [i["anon_rss_mb"] for i in infos]}, tokens


def run_dist(args: argparse.Namespace) -> int:
    import torch

    fill_defaults(args)
    sizes = args.sizes
    if args.mode == "bubble":
        from shardserve.bench.bubble import run_bubble

        return run_bubble(args)
    if args.mode == "expert":
        from shardserve.bench.expert import run_expert

        return run_expert(args)
    if args.mode == "latent":
        from shardserve.bench.latent import run_latent

        return run_latent(args)
    if args.mode == "context":
        from shardserve.bench.context import run_context

        return run_context(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or os.path.join(tmp, "model")
        if args.model is None:
            random_model(args, path)
        g = torch.Generator().manual_seed(0)
        vocab = args.vocab if args.model is None else 1000
        prompts = [torch.randint(vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_prompts)]
        first = None
        for size in sizes:
            record, tokens = one_run(path, size, args, prompts)
            first = first if first is not None else tokens
            record = {"mode": record.pop("mode"), "ranks": size, "same_tokens": tokens == first, **record}
            print(json.dumps(record), flush=True)
    return 0
