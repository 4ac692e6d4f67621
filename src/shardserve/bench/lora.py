"""`shardserve bench lora`: output tokens/s of one batch spread over 1, 4, 16 ... distinct LoRA
adapters, against the same batch on the base model alone, in one engine.

The adapters are random PEFT adapters of the model's shape (every projection, `--lora-rank`),
written to a temporary directory; each batch's requests take them in turn. Every request decodes
exactly `--output-len` tokens (EOS ignored), so every run does the same work; runs alternate over
`--rounds` rounds so a shared machine's drift touches each alike: reported are the median tokens/s
and the median of each round's ratio to that round's base run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import save_file

from shardserve.llm import LLM
from shardserve.loader.lora import CONFIG, TARGETS, WEIGHTS, base_shapes, submodule
from shardserve.loader.model_path import resolve_checkpoint
from shardserve.loader.weights import read_model_config
from shardserve.sampling_params import LoRARequest, SamplingParams


def write_adapter(path: str, model_cfg, rank: int, seed: int) -> None:
    """A random PEFT adapter on every projection; small weights, so the text stays the model's kind."""
    g = torch.Generator().manual_seed(seed)
    shapes = base_shapes(model_cfg)
    tensors = {}
    for layer in range(model_cfg.num_layers):
        for module in TARGETS:
            if module not in shapes.modules:
                continue
            fan_in, fan_out = shapes.modules[module]
            key = f"base_model.model.model.layers.{layer}.{submodule(module)}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, WEIGHTS))
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": [m for m in TARGETS if m in shapes.modules], "bias": "none"}, f)


def run_lora_bench(args: argparse.Namespace, kwargs: dict) -> int:
    """Prints each timed run, then the medians and their ratio to the base model as JSON."""
    counts = sorted(set(args.lora_counts))
    ckpt = resolve_checkpoint(args.model)
    model_cfg = read_model_config(ckpt)
    g = torch.Generator().manual_seed(args.workload_seed)
    prompts = [torch.randint(100, model_cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    kwargs = {**kwargs, "enable_lora": True, "max_loras": max(counts), "max_lora_rank": args.lora_rank,
              "max_cpu_loras": max(counts)}
    with tempfile.TemporaryDirectory(prefix="shardserve-lora-bench-") as root:
        loras = []
        for i in range(max(counts)):
            path = os.path.join(root, f"adapter{i}")
            write_adapter(path, model_cfg, args.lora_rank, seed=i)
            loras.append(LoRARequest(f"adapter{i}", i + 1, path))
        with LLM(**kwargs) as llm:
            runs = {"base": [None] * len(prompts)}
            runs |= {f"{k} adapters": [loras[i % k] for i in range(len(prompts))] for k in counts}
            # Warm the kernels and put every adapter in its slot before timing.
            llm.generate(prompts[: len(loras)], SamplingParams(max_tokens=4), use_tqdm=False, lora_request=loras)
            rates: dict[str, list[float]] = {name: [] for name in runs}
            for r in range(args.rounds):
                for name, chosen in runs.items():
                    start = time.perf_counter()
                    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=chosen)
                    seconds = time.perf_counter() - start
                    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                    rates[name].append(tokens / seconds)
                    print(f"round {r + 1}/{args.rounds} {name}: {tokens} tokens in {seconds:.2f} s "
                          f"({tokens / seconds:.1f} tok/s)", flush=True)
    base = statistics.median(rates["base"])
    result = {"model": ckpt.name, "requests": args.num_requests, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "lora_rank": args.lora_rank, "threads": torch.get_num_threads(),
              "base_tok_s": round(base, 1),
              # Each round's ratio to that round's base run (paired: drift between rounds cancels), median.
              "runs": {name: {"tok_s": round(statistics.median(v), 1),
                              "vs_base": round(statistics.median(x / b for x, b in zip(v, rates["base"])), 3)}
                       for name, v in rates.items() if name != "base"}}
    print(json.dumps(result, indent=1))
    return 0
