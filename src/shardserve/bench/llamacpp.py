"""`shardserve bench offline --compare llama.cpp`: one stream's speed against llama.cpp's own
`llama-bench` on the same GGUF file and thread count.

Two numbers each, as llama-bench defines them: prompt tokens/s (one prompt of PROMPT_TOKENS
random tokens, prefilled at once) and decode tokens/s (tokens generated one at a time by a
single stream). Each is the median of ROUNDS runs; llama-bench reports its mean over the same
number of repetitions. llama-bench is found on PATH, or given with --llama-bench (it builds from
the llama.cpp sources vendored in the llama-cpp-python sdist: `cmake --build build --target
llama-bench`).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time

import torch

from shardserve.bench.batch1 import batch1_ours
from shardserve.llm import LLM
from shardserve.loader.model_path import resolve_checkpoint
from shardserve.sampling_params import SamplingParams

PROMPT_TOKENS = 128
ROUNDS = 3


def find_llama_bench(given: str | None) -> str:
    path = given or os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench")
    if not path or not os.access(path, os.X_OK):
        raise SystemExit("shardserve bench offline --compare llama.cpp: no llama-bench executable (put it on PATH, "
                         "set LLAMA_BENCH, or pass --llama-bench PATH)")
    return path


def prompt_tps(llm: LLM, prompt: list[int]) -> float:
    """Prompt tokens/s: the prompt's length over the time to its first token."""
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), use_tqdm=False)
    return len(prompt) / (time.perf_counter() - t0)


def run_llama_bench(exe: str, gguf: str, threads: int, decode_tokens: int) -> dict[str, float]:
    cmd = [exe, "-m", gguf, "-t", str(threads), "-p", str(PROMPT_TOKENS), "-n", str(decode_tokens),
           "-r", str(ROUNDS), "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"llama-bench failed ({' '.join(cmd)}): {proc.stderr.strip()[-300:]}")
    tests = json.loads(proc.stdout)
    out = {}
    for t in tests:
        key = "prompt_tps" if t["n_prompt"] and not t["n_gen"] else "decode_tps"
        out[key] = float(t["avg_ts"])
    out["build"] = tests[0].get("build_commit", "")
    return out


def run_llamacpp_compare(args, llm: LLM, low: int) -> dict:
    """Both engines' prompt and decode tokens/s for one stream, and the ratios ours/theirs."""
    ckpt = resolve_checkpoint(args.model)
    if not ckpt.is_gguf:
        raise SystemExit("shardserve bench offline --compare llama.cpp needs a GGUF --model (llama.cpp reads no other)")
    exe = find_llama_bench(args.llama_bench)
    threads = torch.get_num_threads()
    k = args.batch1_tokens or 64
    g = torch.Generator().manual_seed(args.workload_seed + 2)
    # A new prompt each round: a repeated one would be answered from the prefix cache.
    prompts = [torch.randint(low, llm.limits.vocab_size, (PROMPT_TOKENS,), generator=g).tolist() for _ in range(ROUNDS)]
    ours = {"prompt_tps": statistics.median(prompt_tps(llm, p) for p in prompts),
            "decode_tps": statistics.median(batch1_ours(llm, p[:8], k) for p in prompts)}
    theirs = run_llama_bench(exe, ckpt.path, threads, k)
    res = {"threads": threads, "prompt_tokens": PROMPT_TOKENS, "decode_tokens": k, "ours": ours, "llama_cpp": theirs,
           "ratio_prompt": ours["prompt_tps"] / theirs["prompt_tps"],
           "ratio_decode": ours["decode_tps"] / theirs["decode_tps"]}
    print(f"one stream, {threads} threads, same GGUF (median of {ROUNDS}; llama-bench: mean of {ROUNDS}):")
    print(f"{'':<34}{'shardserve':>12}{'llama.cpp':>12}{'ratio':>8}")
    print(f"{f'prompt tokens/s ({PROMPT_TOKENS} tokens)':<34}{ours['prompt_tps']:>12.1f}{theirs['prompt_tps']:>12.1f}"
          f"{res['ratio_prompt']:>7.2f}x")
    print(f"{f'decode tokens/s ({k} tokens)':<34}{ours['decode_tps']:>12.1f}{theirs['decode_tps']:>12.1f}"
          f"{res['ratio_decode']:>7.2f}x")
    return res
