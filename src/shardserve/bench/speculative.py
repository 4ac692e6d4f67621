"""`shardserve bench offline --speculative-method ...`: the same engine with and without speculative
decoding, on a workload where proposals pay and on one where they do not, at several batch sizes.

Two workloads of chat prompts, rendered by the model's template and answered greedily until the
model stops (or `--spec-max-tokens`):
- rewrite: each prompt holds a passage (prose or code) and asks for it back with one edit, so the
  answer repeats its input: prompt lookup's best case, and a draft model's too;
- chat: open questions whose answers repeat nothing: what speculation costs when it finds little.

Both engines are loaded at once and run alternately, `--spec-rounds` times, so a shared machine's
drift touches both alike; a size's requests run in groups of that size (`generate` admits a group
at once). Reported: output tokens/s of each, their ratio (median over rounds), the acceptance
rate and tokens per verified step from the engine's counters, and whether every output was equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shardserve.llm import LLM
from shardserve.sampling_params import SamplingParams

PASSAGES = [
    "The old lighthouse stood at the edge of the cliff for two hundred years. Every night its keeper climbed the "
    "narrow stairs, lit the great lamp and watched the ships pass safely through the dark water below.",
    "def moving_average(values, window):\n    result = []\n    for i in range(len(values) - window + 1):\n"
    "        chunk = values[i:i + window]\n        result.append(sum(chunk) / window)\n    return result\n",
    "Our team meets every Monday at nine to review the week ahead. Each person shares one goal, one risk and one "
    "thing they need from the others, and the meeting ends when everyone knows what to do first.",
    "To make the bread, mix the flour, water, salt and yeast in a large bowl. Knead the dough for ten minutes, let "
    "it rise for an hour, shape it into a loaf and bake it until the crust is golden brown.",
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, word):\n"
    "        self.counts[word] = self.counts.get(word, 0) + 1\n\n    def top(self, n):\n"
    "        return sorted(self.counts.items(), key=lambda kv: -kv[1])[:n]\n",
    "The museum opens at ten in the morning and closes at six in the evening. Tickets can be bought at the door or "
    "online, and children under twelve enter for free with an adult.",
    "Dear Maria, thank you for your letter and for the photographs of the garden. The roses look wonderful this "
    "year, and I hope to visit you in the summer when the apples are ready.",
    "SELECT customer_id, COUNT(*) AS orders, SUM(total) AS revenue\nFROM orders\nWHERE created_at >= '2024-01-01'\n"
    "GROUP BY customer_id\nORDER BY revenue DESC\nLIMIT 10;\n",
]
EDITS = [("the", "a"), ("and", "but"), ("values", "numbers"), ("one", "two"), ("counts", "totals"),
         ("ten", "eleven"), ("garden", "orchard"), ("orders", "purchases")]
QUESTIONS = [
    "Write a short poem about the sea at night.", "Why is the sky blue? Explain it to a child.",
    "Give me three ideas for a birthday party.", "What should I pack for a week of hiking?",
    "Describe your favourite season and why.", "How do plants make their food?",
    "Tell me a short story about a lost dog.", "What are good habits for learning a language?",
]


def rewrite_prompts(n: int) -> list[list[dict]]:
    out = []
    for i in range(n):
        text, (old, new) = PASSAGES[i % len(PASSAGES)], EDITS[(i // len(PASSAGES) + i) % len(EDITS)]
        out.append([{"role": "user", "content": f"Rewrite the following text exactly as it is, except replace the "
                                                f"word '{old}' with '{new}' everywhere:\n\n{text}"}])
    return out


def chat_prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]


def timed_run(llm: LLM, prompts: list[list[int]], size: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds for every prompt, `size` at a time, and the outputs."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    start, outs = time.perf_counter(), []
    for b in range(0, len(prompts), size):
        outs += [o.token_ids for o in llm.generate(prompts[b : b + size], params, use_tqdm=False)]
    return time.perf_counter() - start, outs


def spec_counts(llm: LLM) -> dict:
    return dict(llm.stats().speculative)


def delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before.get(k, 0) for k in ("drafts", "proposed", "accepted", "emitted")}
    d["acceptance_rate"] = d["accepted"] / d["proposed"] if d["proposed"] else 0.0
    d["tokens_per_step"] = d["emitted"] / d["drafts"] if d["drafts"] else 0.0
    return d


def compare(plain: LLM, spec: LLM, prompts: list[list[int]], size: int, args: argparse.Namespace) -> dict:
    rounds, equal, before = [], len(prompts), spec_counts(spec)
    for _ in range(args.spec_rounds):
        t_plain, out_plain = timed_run(plain, prompts, size, args.spec_max_tokens)
        t_spec, out_spec = timed_run(spec, prompts, size, args.spec_max_tokens)
        tokens = sum(map(len, out_plain))
        rounds.append((tokens / t_plain, sum(map(len, out_spec)) / t_spec))
        same = [a == b for a, b in zip(out_plain, out_spec)]
        equal = min(equal, sum(same))
        # Where outputs differ (an engine that is not batch-invariant, e.g. bf16 through torch's
        # matmuls): how many tokens they shared first.
        shared = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                  for a, b, ok in zip(out_plain, out_spec, same) if not ok]
    counts = delta(spec_counts(spec), before)
    return {"batch_size": size, "requests": len(prompts), "output_tokens": tokens, "plain_tps": [a for a, _ in rounds],
            "spec_tps": [b for _, b in rounds], "ratio": statistics.median(b / a for a, b in rounds),
            "outputs_equal": equal, "first_difference_at": shared, **counts}


def run_speculative_bench(args: argparse.Namespace, engine: dict) -> int:
    """Print a table per workload and one final JSON line."""
    spec_cfg = engine["speculative_config"]
    plain = LLM(**{**engine, "speculative_config": None})
    spec = LLM(**engine)
    sizes = args.spec_batch_sizes
    result: dict = {"method": spec_cfg.method, "num_speculative_tokens": spec_cfg.num_speculative_tokens,
                    "torch_threads": torch.get_num_threads(), "workloads": {}}
    warm = plain.render_chat(chat_prompts(1)[0])
    for llm in (plain, spec):
        llm.generate([warm], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    makers = {"rewrite": rewrite_prompts, "chat": chat_prompts}
    for name in args.spec_workloads:
        rows = []
        for size in sizes:
            prompts = [plain.render_chat(c) for c in makers[name](max(args.spec_requests, size))]
            rows.append(compare(plain, spec, prompts, size, args))
        result["workloads"][name] = rows
        print(f"{name}: {spec_cfg.method}, K={spec_cfg.num_speculative_tokens}, greedy, up to {args.spec_max_tokens} "
              f"tokens, {result['torch_threads']} torch threads")
        print(f"{'batch':>6}{'plain tok/s':>13}{'spec tok/s':>12}{'ratio':>8}{'accept':>8}{'tok/step':>10}"
              f"{'equal':>8}")
        for r in rows:
            print(f"{r['batch_size']:>6}{statistics.median(r['plain_tps']):>13.1f}"
                  f"{statistics.median(r['spec_tps']):>12.1f}{r['ratio']:>7.2f}x{r['acceptance_rate']:>8.2f}"
                  f"{r['tokens_per_step']:>10.2f}{r['outputs_equal']:>5}/{r['requests']:<2}"
                  + (f"  first differing token at {r['first_difference_at']}" if r["first_difference_at"] else ""))
    result["ranks"] = rank_costs(spec, result)
    plain.shutdown()
    spec.shutdown()
    print(json.dumps(result))
    return 0


def rank_costs(spec: LLM, result: dict) -> list[dict]:
    """Per rank: the weights it holds (target and draft) and the draft's own collectives per
    proposed token (a draft sharded like the target: `--speculative-draft-tp same`)."""
    proposed = sum(r["proposed"] for rows in result["workloads"].values() for r in rows)
    info = spec.worker_info
    out = []
    for rep in spec.rank_reports() if len(info) > 1 else [{"rank": 0, "groups": {}}]:
        mine = info[f"scheduler-{rep['rank']}"]
        draft = rep["groups"].get("draft", {})
        calls = sum(op["calls"] for op in draft.values())
        mb = sum(op["MB"] for op in draft.values())
        row = {"rank": rep["rank"], "weight_mb": mine.get("weight_mb"), "draft_weight_mb": mine.get("draft_weight_mb"),
               "draft_calls_per_proposed": calls / proposed if proposed else 0.0,
               "draft_bytes_per_proposed": mb * 1e6 / proposed if proposed else 0.0}
        out.append(row)
        print(f"rank {row['rank']}: weights {row['weight_mb']} MB, the draft's {row['draft_weight_mb']} MB; its "
              f"collectives per "
              f"proposed token: {row['draft_calls_per_proposed']:.1f} calls, {row['draft_bytes_per_proposed']:.0f} "
              f"bytes")
    return out
