"""`shardserve bench {offline,batch1,lora,serve,dist,disagg,soak}`: the flags of each benchmark.

Parsing imports no torch (the `serve` command builds these parsers too); each benchmark imports
its own machinery when it runs (bench_run.py dispatches).
"""

from __future__ import annotations

import argparse
import math

from shardserve.cli.flag_types import (
    memory_amount,
    non_negative_int,
    positive_float,
    positive_int,
    positive_ints,
    seed_int,
)
from shardserve.cli.flags import add_engine_args
from shardserve.config import DTYPES
from shardserve.logs import LOG_LEVELS


def add_bench_args(bench: argparse.ArgumentParser) -> None:
    sub = bench.add_subparsers(dest="bench", required=True)
    add_dist_args(sub.add_parser("dist", help="tensor-parallel runs at several sizes, with traffic counts"))
    off = sub.add_parser("offline", help="offline throughput on a fixed random workload")
    add_engine_args(off)
    off.add_argument("--num-requests", type=positive_int, default=64)
    off.add_argument("--min-prompt", type=positive_int, default=32)
    off.add_argument("--max-prompt", type=positive_int, default=512)
    off.add_argument("--min-output", type=positive_int, default=16)
    off.add_argument("--max-output", type=positive_int, default=256)
    off.add_argument("--workload-seed", type=seed_int, default=0)
    off.add_argument("--compare", choices=["transformers", "llama.cpp", "vllm"], default=None,
                     help="transformers: also run it on the same requests and print the ratio; llama.cpp: one "
                          "stream's prompt and decode tokens/s against llama-bench on the same GGUF; vllm: the same "
                          "requests through vLLM's CPU backend in its own venv (needs an HF directory --model)")
    off.add_argument("--llama-bench", default=None,
                     help="the llama-bench executable for --compare llama.cpp (default: $LLAMA_BENCH, then PATH)")
    off.add_argument("--vllm-python", default=None,
                     help="python of vLLM's virtual environment for --compare vllm (default: $VLLM_PYTHON, then "
                          "/tmp/peers/vllm/bin/python)")
    off.add_argument("--vllm-kv-cache-space", type=positive_int, default=4,
                     help="GiB of KV cache for vLLM (VLLM_CPU_KVCACHE_SPACE)")
    off.add_argument("--vllm-enforce-eager", action="store_true",
                     help="run vLLM as its --enforce-eager does (no torch.compile): it starts faster and runs "
                          "its eager speed, which the result then states")
    off.add_argument("--hf-batch-size", type=positive_int, default=16,
                     help="static batch size for the transformers peer")
    off.add_argument("--batch1-tokens", type=non_negative_int, default=64,
                     help="also time batch-1 decode of this many tokens (0 = skip)")
    add_sampling_args(off)
    off.add_argument("--json-schema", action="store_true",
                     help="run again with every output held to a JSON schema and print the decode slowdown")
    spec = off.add_argument_group("with --speculative-method: the engine with and without it, paired")
    spec.add_argument("--spec-workloads", type=spec_workloads, default=["rewrite", "chat"],
                      help="comma-separated: rewrite (answers repeat the prompt with an edit), chat (they do not)")
    spec.add_argument("--spec-batch-sizes", type=positive_ints, default=(1, 8),
                      help="comma-separated batch sizes")
    spec.add_argument("--spec-requests", type=positive_int, default=8,
                      help="requests per workload and size (at least the size)")
    spec.add_argument("--spec-max-tokens", type=positive_int, default=256)
    spec.add_argument("--spec-rounds", type=positive_int, default=2, help="alternating rounds of both engines")
    add_lora_bench_args(sub.add_parser("lora", help="output tokens/s of a batch over 1, 4, 16 LoRA adapters vs the "
                                                    "base model alone"))
    add_batch1_args(sub.add_parser("batch1", help="one stream's decode tokens/s in several dtypes, in alternating "
                                                   "rounds"))
    add_serve_bench_args(sub.add_parser("serve", help="load-test an OpenAI-compatible server over HTTP"))
    add_disagg_args(sub.add_parser("disagg", help="1 prefill + 1 decode instance vs one colocated server, mixed "
                                                  "workload"))
    add_soak_args(sub.add_parser("soak", help="mixed traffic for a while, replicas killed at random; then checks "
                                              "that no request was lost and nothing leaked"))


def dtype_list(text: str) -> list[str]:
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPES for d in dtypes) or len(set(dtypes)) != len(dtypes):
        raise argparse.ArgumentTypeError(f"expected distinct dtypes from {list(DTYPES)}, comma-separated; got {text!r}")
    return dtypes


def add_batch1_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--dtypes", type=dtype_list, default=["bfloat16", "float32"],
                   help="comma-separated; each ratio is the first's tokens/s over another's")
    p.add_argument("--tokens", type=positive_int, default=128, help="tokens each run decodes (the first excluded)")
    p.add_argument("--prompt-len", type=positive_int, default=32)
    p.add_argument("--rounds", type=positive_int, default=5, help="alternating rounds of every dtype")
    p.add_argument("--workload-seed", type=seed_int, default=0)


def add_lora_bench_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--num-requests", type=positive_int, default=32, help="requests in the batch")
    p.add_argument("--prompt-len", type=positive_int, default=64)
    p.add_argument("--output-len", type=positive_int, default=64, help="tokens each request decodes (EOS ignored)")
    p.add_argument("--lora-rank", type=positive_int, default=16, help="rank of the random adapters")
    p.add_argument("--lora-counts", type=positive_ints, default=(1, 4, 16),
                   help="comma-separated numbers of distinct adapters the batch is spread over")
    p.add_argument("--rounds", type=positive_int, default=2, help="alternating rounds of every run")
    p.add_argument("--workload-seed", type=seed_int, default=0)


def add_soak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spawn", default=None, metavar="SERVE_ARGS",
                   help='start `shardserve serve SERVE_ARGS` for the run, e.g. "--dp-size 2" (needed for kills)')
    p.add_argument("--url", default=None, help="an already running server instead (no kills, no memory check)")
    p.add_argument("--duration", type=positive_float, default=180.0, help="seconds of load in all")
    p.add_argument("--warmup", type=positive_float, default=20.0,
                   help="seconds of load before the first kill and the first memory reading")
    p.add_argument("--clients", type=positive_int, default=4, help="concurrent clients")
    p.add_argument("--kill-every", type=float, default=30.0,
                   help="mean seconds between SIGKILLs of a random serving replica's rank (0: none)")
    p.add_argument("--max-tokens", type=positive_int, default=16)
    p.add_argument("--max-rss-growth", type=float, default=0.05,
                   help="largest growth of the server's resident memory after warm-up, as a fraction")
    p.add_argument("--request-timeout", type=positive_float, default=120.0)
    p.add_argument("--settle-timeout", type=positive_float, default=180.0,
                   help="seconds to wait at the end for the replicas to serve again and fall idle")
    p.add_argument("--startup-timeout", type=positive_float, default=600.0)
    p.add_argument("--seed", type=seed_int, default=0, help="seeds the clients' choices and the kills")


def spec_workloads(text: str) -> list[str]:
    names = text.split(",")
    bad = [n for n in names if n not in ("rewrite", "chat")]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown workload(s) {bad} (rewrite, chat)")
    return names


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    """Flags of `shardserve bench serve`."""
    from shardserve.bench.serve import DEFAULT_OUTPUT, DEFAULT_PROMPT

    p.add_argument("--url", default=None,
                   help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (needed unless "
                        "--spawn or --spawn-router starts servers)")
    p.add_argument("--num-requests", type=positive_int, default=64)
    p.add_argument("--request-rate", type=positive_float, default=math.inf,
                   help="requests/s with Poisson arrivals (default inf: all at once)")
    p.add_argument("--min-prompt", type=positive_int, default=None,
                   help=f"prompt length in words (default {DEFAULT_PROMPT[0]}, or --max-prompt if smaller)")
    p.add_argument("--max-prompt", type=positive_int, default=DEFAULT_PROMPT[1])
    p.add_argument("--min-output", type=positive_int, default=None,
                   help=f"output tokens (default {DEFAULT_OUTPUT[0]}, or --max-output if smaller)")
    p.add_argument("--max-output", type=positive_int, default=DEFAULT_OUTPUT[1])
    p.add_argument("--seed", type=seed_int, default=0, help="seeds the prompts, output lengths and arrival times")
    p.add_argument("--model-name", default=None, help="`model` field to send (default: first id of GET /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="this process's log level")
    add_sampling_args(p)
    add_shared_prefix_args(p)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """What every request of a run samples with (vLLM's benchmark flags); greedy by default."""
    s = p.add_argument_group("sampling of every request (default: greedy)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1, help="-1 (the default): off")
    s.add_argument("--min-p", type=float, default=0.0)


def sampling_of(args: argparse.Namespace) -> dict:
    """The sampling flags as request fields (the temperature, and the others where not off), checked
    as a request's are: exits naming the flag."""
    from shardserve.sampling_params import SamplingParams

    fields = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
    try:
        SamplingParams(**fields)
    except ValueError as e:
        name = next(f for f in fields if f"SamplingParams.{f} " in str(e))
        why = str(e).split(" ", 1)[1]
        raise SystemExit(f"shardserve bench {args.bench}: --{name.replace('_', '-')} {why}") from None
    off = SamplingParams()  # fields left at their defaults stay out of requests: a greedy body stays as it was
    return {k: v for k, v in fields.items() if k == "temperature" or v != getattr(off, k)}


def add_shared_prefix_args(p: argparse.ArgumentParser) -> None:
    from shardserve.router.policy import POLICIES

    w = p.add_argument_group("shared-prefix workload (bench/shared_prefix.py)")
    w.add_argument("--workload", choices=["random", "shared-prefix"], default="random",
                   help="random word prompts, or groups of requests sharing a long system prompt")
    w.add_argument("--num-groups", type=positive_int, default=8, help="groups sharing one prefix each")
    w.add_argument("--prefix-words", type=positive_int, default=300, help="words in each group's shared prefix")
    w.add_argument("--suffix-words", type=positive_int, default=12, help="words in each request's own question")
    w.add_argument("--spawn", default=None, metavar="SERVE_FLAGS",
                   help='start `shardserve serve SERVE_FLAGS --load-balance-method P` for each policy, e.g. '
                        '"--dp-size 2"')
    w.add_argument("--spawn-router", default=None, metavar="SERVE_FLAGS",
                   help="start --router-workers servers and `shardserve router --policy P` for each policy")
    w.add_argument("--router-workers", type=positive_int, default=2)
    w.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated policies to compare with --spawn / --spawn-router")



def add_dist_args(p: argparse.ArgumentParser) -> None:
    from shardserve.bench.dist import SHAPES  # plain Python: the shapes, no torch

    p.add_argument("--model", default=None, help="checkpoint (default: a random model of the shape below)")
    # Shape and workload: None means the mode's own default (SHAPES), shown in --help.
    for flag in SHAPES["tensor"]:
        base, bubble = SHAPES["tensor"][flag], SHAPES["bubble"][flag]
        text = f"default {base}" + (f" (bubble: {bubble})" if bubble != base else "")
        p.add_argument(f"--{flag.replace('_', '-')}", type=positive_int, default=None, help=text)
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--kv-cache-memory", type=memory_amount, default=None,
                   help="bytes of KV cache per rank (default 64M; bubble: 512M; latent: 1M)")
    p.add_argument("--mode", choices=["tensor", "pipeline", "bubble", "expert", "latent", "context"], default="tensor",
                   help="which layout to vary (bubble: pipeline micro-batches against one, and TP, on throughput; "
                        "expert: EP under data-parallel attention beside TP, and redundant experts; "
                        "latent: a DeepSeek-shaped model's latent KV cache under TP against data-parallel attention; "
                        "context: --cp-size on one long prompt, --prompt-len default 2048, --new-tokens 4)")
    p.add_argument("--experts", type=positive_int, default=8, help="expert mode: experts per MoE layer")
    p.add_argument("--top-k", type=positive_int, default=2, help="expert mode: experts per token")
    p.add_argument("--sizes", "--tp-sizes", dest="sizes", type=positive_ints, default="1,2,4",
                   help="comma-separated sizes of the varied layout (--tp-size or --pp-size)")
    p.add_argument("--pp-micro-batches", type=positive_int, default=None,
                   help="pipeline micro-batches in flight (default: one per stage)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--bubble-requests", type=positive_int, default=96, help="bubble mode: requests")
    p.add_argument("--bubble-max-tokens", type=positive_int, default=48,
                   help="bubble mode: the longest output (lengths vary from a third of it up)")



def add_disagg_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads in all: the colocated server's; the "
                                                          "prefill and decode instances get half each")
    p.add_argument("--streams", type=int, default=8, help="decode streams running from the start")
    p.add_argument("--stream-tokens", type=int, default=192)
    p.add_argument("--long-prompts", type=int, default=6)
    p.add_argument("--long-words", type=int, default=600, help="words per long prompt")
    p.add_argument("--long-every", type=float, default=1.5, help="seconds between long prompts")
    p.add_argument("--num-pages", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="every server's prefill chunk budget (smaller chunks stall a colocated server's streams "
                        "for less time, at some prefill speed)")
    p.add_argument("--seed", type=int, default=0)
