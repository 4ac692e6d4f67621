"""`shardserve record-experts`: run prompts through a MoE model and write its routing counts.

The file (distributed/expert_placement.py's format) is what `--ep-expert-placement` reads to place
`--ep-num-redundant-experts` copies of the hottest experts. Record on prompts like the traffic the
server will see: `--prompts FILE` (one prompt per line), else a few built-in ones. Any layout
works: each layer's count sums the replicas' tensor rank 0s (every rank of a tensor group routes
all of its tokens, so one stands for the group).
"""

from __future__ import annotations

import argparse
import sys

BUILT_IN = [
    "Explain how a transformer language model turns a prompt into text.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List five tips for writing clear technical documentation.",
    "What is the difference between a process and a thread?",
    "Translate into French: The weather is lovely today, let us walk to the harbour.",
    "def fibonacci(n):\n    # return the n-th Fibonacci number",
    "Summarise the causes of the French Revolution in three sentences.",
    "Solve step by step: a train leaves at 9:40 and travels 210 km at 84 km/h. When does it arrive?",
]


def add_record_args(p: argparse.ArgumentParser) -> None:
    from shardserve.cli.flag_types import positive_int
    from shardserve.cli.flags import add_engine_args

    add_engine_args(p)
    p.add_argument("--output", "-o", required=True, help="where to write the counts (JSON)")
    p.add_argument("--prompts", default=None, help="text file, one prompt per line (default: built-in prompts)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="tokens generated per prompt")


def record_experts(args: argparse.Namespace) -> int:
    from shardserve.cli.flags import llm_kwargs
    from shardserve.distributed.expert_placement import layer_counts, save_counts
    from shardserve.llm import LLM
    from shardserve.loader.model_path import resolve_checkpoint
    from shardserve.loader.weights import read_model_config
    from shardserve.sampling_params import SamplingParams

    experts = read_model_config(resolve_checkpoint(args.model)).num_experts
    if experts == 0:
        raise ValueError(f"{args.model} is not a mixture-of-experts model: there are no routing counts to record")

    if args.prompts:
        with open(args.prompts, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
        if not prompts:
            raise ValueError(f"--prompts {args.prompts}: no prompt in the file")
    else:
        prompts = BUILT_IN
    with LLM(**llm_kwargs(args)) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0), use_tqdm=True)
        counts = layer_counts(llm.rank_reports(), llm.layout)
    save_counts(args.output, counts, experts, args.model)
    routed = sum(sum(c) for c in counts.values())
    print(f"recorded {routed} token-expert routings over {len(counts)} MoE layers of {len(prompts)} prompts "
          f"to {args.output}", file=sys.stderr)
    return 0
