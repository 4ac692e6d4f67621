"""`shardserve bench offline`: throughput and time to first token on a fixed random workload.

Our engine is driven step by step (`EngineCore.add_request` / `step`) so each request's first
token can be timestamped. With `--compare transformers` the same requests also go through
transformers' batched `generate` (static batches, left padding), which streams nothing: its
"TTFT" is the time until the request's batch completes. With `--json-schema` the workload and the
batch-1 decode run again with every output held to a JSON schema (structured outputs), and the
ratio of tokens/s on to off is the cost of the per-step grammar mask. With `--compare vllm` the
workload also runs through vLLM's CPU backend in its own virtual environment (bench/vllm_peer.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass

import torch

from shardserve.bench.batch1 import batch1_ours
from shardserve.bench.runs import sampling_text
from shardserve.bench.vllm_peer import check_vllm_compare, run_vllm_compare
from shardserve.config import torch_dtype
from shardserve.llm import LLM
from shardserve.loader.model_path import resolve_checkpoint
from shardserve.platform import pick_device
from shardserve.sampling_params import SamplingParams
from shardserve.structured_outputs import StructuredOutputsParams

BATCH1_PROMPT = 32
NUM_CHECKED = 4  # requests whose greedy tokens are compared with the peer's (transformers or vLLM)
# The table's footnote on each peer's TTFT and wall time.
PEER_NOTES = {"transformers": "; transformers streams nothing, so its TTFT is the time until the request's batch "
                              "completes",
              "vLLM": "; vLLM: generate() returns every request at once, so no TTFT (-), and its wall time is "
                      "generate() alone, after its start-up and a warm-up, as ours is"}
# --json-schema: an array of small typed objects, too long to be complete before max_tokens; runs
# JSON_ROUNDS pairs without and with it.
JSON_ROUNDS = 3
BENCH_SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "color", "ok"],
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}}}


@dataclass
class Workload:
    """The requests: token-id prompts and the number of tokens each must generate."""

    prompts: list[list[int]]
    output_lens: list[int]


def make_workload(args: argparse.Namespace, vocab: int) -> Workload:
    """Seeded random prompts drawn from [min(100, vocab // 2), vocab), avoiding special ids."""
    if args.min_prompt > args.max_prompt or args.min_output > args.max_output:
        raise SystemExit("shardserve bench offline: --min-* must not exceed --max-*")
    g = torch.Generator().manual_seed(args.workload_seed)
    low = min(100, vocab // 2)
    n = args.num_requests
    plens = torch.randint(args.min_prompt, args.max_prompt + 1, (n,), generator=g).tolist()
    olens = torch.randint(args.min_output, args.max_output + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(low, vocab, (p,), generator=g).tolist() for p in plens]
    return Workload(prompts, olens)


def summarize(wall: float, ttfts: list[float], prompt_tokens: int, output_tokens: int) -> dict[str, float]:
    """Throughputs over wall time and TTFT statistics (seconds) across requests."""
    q = statistics.quantiles(ttfts, n=10, method="inclusive") if len(ttfts) > 1 else ttfts * 9
    return {
        "wall_s": wall, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "output_tps": output_tokens / wall, "total_tps": (prompt_tokens + output_tokens) / wall,
        "ttft_mean_s": statistics.fmean(ttfts), "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": q[8],
    }


def run_ours(llm: LLM, wl: Workload, spec: StructuredOutputsParams | None = None, sampling: dict | None = None,
             ) -> tuple[dict[str, float], list[list[int]]]:
    """Run every request through our engine at once; timestamp each request's first token.
    `sampling`: temperature, top_p, top_k, min_p for every request (default greedy), seeded by
    its position."""
    sampling = sampling or {"temperature": 0}
    start = time.perf_counter()
    rids = [llm.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, structured_outputs=spec, seed=i,
                                              **sampling))
            for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens, strict=True))]
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    left = set(rids)
    while left:
        for out in llm.step():
            first.setdefault(out.rid, time.perf_counter() - start)
            tokens[out.rid].extend(out.new_ids)
            if out.finished:
                left.discard(out.rid)
    wall = time.perf_counter() - start
    outputs = [tokens[r] for r in rids]
    stats = summarize(wall, [first[r] for r in rids], sum(map(len, wl.prompts)), sum(map(len, outputs)))
    return stats, outputs


def load_transformers(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The same checkpoint in transformers, in the same dtype, on the same device."""
    from transformers import AutoModelForCausalLM

    ckpt = resolve_checkpoint(args.model)
    kw = {"gguf_file": os.path.basename(ckpt.path)} if ckpt.is_gguf else {}
    where = os.path.dirname(ckpt.path) if ckpt.is_gguf else ckpt.path
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype(args.dtype), **kw)
    return model.to(device).eval()


def hf_generate(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy batched generate with left padding; exactly `new_tokens` tokens per row."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, width:].tolist()


def run_transformers(model: torch.nn.Module, wl: Workload, batch_size: int) -> tuple[dict[str, float],
                                                                                     list[list[int]]]:
    """Static batches in request order; tokens past each request's own length are discarded."""
    start = time.perf_counter()
    outputs: list[list[int]] = []
    ttfts: list[float] = []
    for b in range(0, len(wl.prompts), batch_size):
        lens = wl.output_lens[b:b + batch_size]
        rows = hf_generate(model, wl.prompts[b:b + batch_size], max(lens))
        outputs += [row[:n] for row, n in zip(rows, lens, strict=True)]
        ttfts += [time.perf_counter() - start] * len(lens)
    wall = time.perf_counter() - start
    stats = summarize(wall, ttfts, sum(map(len, wl.prompts)), sum(map(len, outputs)))
    return stats, outputs


def batch1_transformers(model: torch.nn.Module, prompt: list[int], k: int) -> float:
    """Decode tokens/s at batch 1: (time for k tokens - time for 1 token) over k - 1 tokens."""
    t0 = time.perf_counter()
    hf_generate(model, [prompt], 1)
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf_generate(model, [prompt], k)
    return (k - 1) / (time.perf_counter() - t0 - one)


def greedy_match(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, int]:
    """How many of the first NUM_CHECKED requests produced identical tokens in both engines."""
    pairs = list(zip(ours, theirs, strict=True))[:NUM_CHECKED]
    return {"equal": sum(a == b for a, b in pairs), "compared": len(pairs)}


def print_table(ours: dict, theirs: dict | None, peer: str = "transformers") -> None:
    """Print both engines' numbers side by side ('-' where the peer has none)."""
    rows = [("output tokens/s", "output_tps"), ("total tokens/s", "total_tps"), ("TTFT mean (s)*", "ttft_mean_s"),
            ("TTFT p50 (s)*", "ttft_p50_s"), ("TTFT p90 (s)*", "ttft_p90_s"), ("wall time (s)", "wall_s"),
            ("output tokens", "output_tokens"), ("prompt tokens", "prompt_tokens")]
    print(f"{'':<18}{'shardserve':>14}" + (f"{peer:>14}" if theirs else ""))
    for label, key in rows:
        fmt = "{:>14d}" if key.endswith("tokens") else "{:>14.3f}"
        peer_cell = (fmt.format(theirs[key]) if key in theirs else f"{'-':>14}") if theirs else ""
        print(f"{label:<18}" + fmt.format(ours[key]) + peer_cell)
    print("* TTFT: time from the start of the run to the request's first token" + (PEER_NOTES[peer] if theirs else ""))


def run_batch1(args: argparse.Namespace, llm: LLM, hf: torch.nn.Module | None, low: int) -> dict:
    """Batch-1 decode tokens/s for us and (if compared) transformers, plus their ratio."""
    g = torch.Generator().manual_seed(args.workload_seed + 1)
    prompt = torch.randint(low, llm.limits.vocab_size, (BATCH1_PROMPT,), generator=g).tolist()
    k = args.batch1_tokens
    res: dict = {"tokens": k, "prompt_tokens": BATCH1_PROMPT, "ours_decode_tps": batch1_ours(llm, prompt, k)}
    print(f"batch-1 decode tokens/s ({k} tokens after a {BATCH1_PROMPT}-token prompt, first token excluded):")
    print(f"  shardserve    {res['ours_decode_tps']:.2f}")
    if hf is not None:
        res["transformers_decode_tps"] = batch1_transformers(hf, prompt, k)
        res["ratio"] = res["ours_decode_tps"] / res["transformers_decode_tps"]
        print(f"  transformers  {res['transformers_decode_tps']:.2f}")
        print(f"  ratio ours/transformers  {res['ratio']:.2f}x")
    return res


def warm_up(llm: LLM, hf: torch.nn.Module | None, low: int) -> None:
    """One short generation in each engine, so one-time setup costs stay out of the timings."""
    prompt = list(range(low, low + 8))
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
    if hf is not None:
        hf_generate(hf, [prompt], 2)


def run_offline(args: argparse.Namespace, engine: dict) -> int:
    """Run the benchmark, print a table and one final JSON line with every number. `engine`:
    LLM(...)'s keyword arguments for the engine flags."""
    if args.batch1_tokens == 1 or args.batch1_tokens < 0:
        raise SystemExit("shardserve bench offline: --batch1-tokens must be 0 (skip) or >= 2")
    sampled = args.sampling["temperature"] > 0
    if sampled and args.compare == "transformers":
        raise SystemExit("shardserve bench offline: --compare transformers runs greedy only; drop --temperature")
    vllm_python = check_vllm_compare(args) if args.compare == "vllm" else None  # before anything loads
    llm = LLM(**engine)
    vocab = llm.limits.vocab_size
    low = min(100, vocab // 2)
    wl = make_workload(args, vocab)
    hf = load_transformers(args, pick_device(args.device)) if args.compare == "transformers" else None
    warm_up(llm, hf, low)
    result: dict = {"ours": None, "transformers": None, "ratio_output_tps": None, "batch1": None,
                    "torch_threads": torch.get_num_threads(),
                    "attention": llm.worker_info["scheduler-0"]["attention"]}
    result["ours"], ours_tokens = run_ours(llm, wl, sampling=args.sampling)
    peer = {"transformers": "transformers", "vllm": "vLLM"}.get(args.compare)
    if hf is not None:
        result["transformers"], peer_tokens = run_transformers(hf, wl, args.hf_batch_size)
    if vllm_python is not None:
        result["vllm"], peer_tokens = run_vllm_compare(args, vllm_python, wl.prompts, wl.output_lens,
                                                       result["torch_threads"], args.sampling)
    theirs = result.get(args.compare) if peer else None
    if theirs:
        result["ratio_output_tps"] = result["ours"]["output_tps"] / theirs["output_tps"]
        if not sampled:  # sampled tokens differ between engines by design
            result["greedy_match"] = greedy_match(ours_tokens, peer_tokens)
    print(f"workload: {len(wl.prompts)} requests, prompts {args.min_prompt}-{args.max_prompt} tokens, "
          f"outputs {args.min_output}-{args.max_output} tokens, ignore_eos, {sampling_text(args.sampling)}, "
          f"dtype {args.dtype}, "
          f"{result['torch_threads']} torch threads, attention {result['attention']}")
    print_table(result["ours"], theirs, peer or "transformers")
    if theirs:
        eager = " (vLLM eager: --vllm-enforce-eager)" if theirs.get("eager") else ""
        print(f"output tokens/s ratio ours/{peer}: {result['ratio_output_tps']:.2f}x{eager}")
    if theirs and not sampled:
        m = result["greedy_match"]
        whose = peer + ("'" if peer.endswith("s") else "'s")
        print(f"greedy tokens equal to {whose} (first {NUM_CHECKED} requests): {m['equal']}/{m['compared']}")
    if args.batch1_tokens:
        result["batch1"] = run_batch1(args, llm, hf, low)
    if args.compare == "llama.cpp":
        from shardserve.bench.llamacpp import run_llamacpp_compare

        result["llama_cpp"] = run_llamacpp_compare(args, llm, low)
    if args.json_schema:
        result["json_schema"] = run_json_schema(args, llm, wl, low, result)
    print(json.dumps(result))
    return 0


def run_json_schema(args: argparse.Namespace, llm: LLM, wl: Workload, low: int, result: dict) -> dict:
    """The workload and batch-1 decode again, alternately without and with every output held to
    BENCH_SCHEMA, JSON_ROUNDS pairs: on a shared machine the median ratio of a pair run back to back
    is steadier than one run against the table's."""
    spec = StructuredOutputsParams(json=BENCH_SCHEMA)
    # Warm-up: the tokenizer's index for the grammar engine and the schema's compilation, once.
    llm.generate([list(range(low, low + 8))], SamplingParams(max_tokens=2, temperature=0, structured_outputs=spec),
                 use_tqdm=False)
    pairs = [(run_ours(llm, wl)[0]["output_tps"], run_ours(llm, wl, spec)[0]["output_tps"]) for _ in range(JSON_ROUNDS)]
    res: dict = {"output_tps_off_on": pairs, "ratio_output_tps": statistics.median(on / off for off, on in pairs)}
    print(f"with a JSON schema: output tokens/s {' '.join(f'{on:.1f}/{off:.1f}' for off, on in pairs)} (on/off), "
          f"median ratio {res['ratio_output_tps']:.3f}x")
    if result["batch1"]:
        g = torch.Generator().manual_seed(args.workload_seed + 1)  # run_batch1's prompt
        prompt = torch.randint(low, llm.limits.vocab_size, (BATCH1_PROMPT,), generator=g).tolist()
        k = args.batch1_tokens
        pairs = [(batch1_ours(llm, prompt, k), batch1_ours(llm, prompt, k, spec)) for _ in range(JSON_ROUNDS)]
        res |= {"batch1_decode_tps_off_on": pairs, "batch1_ratio": statistics.median(on / off for off, on in pairs)}
        print(f"with a JSON schema: batch-1 decode tokens/s {' '.join(f'{on:.2f}/{off:.2f}' for off, on in pairs)} "
              f"(on/off), median ratio {res['batch1_ratio']:.3f}x")
    return res
