"""`shardserve bench dist --mode expert`: expert parallelism under data-parallel attention, beside
tensor parallelism on the same ranks, and hot-expert replicas on a skewed gate.

The model is the default config's MoE variant (a random Qwen3-MoE: 4 layers, hidden 512, 8 experts,
top 2, fp32); 8 prompts x 64 tokens, 16 new. For each size E (`--sizes`, default 1,2,4) three JSON
lines:

- `expert`: E ranks, E attention replicas of one rank each (`--tp-size E --dp-size E
  --enable-dp-attention`, the prompts spread over them by least load): same_tokens (equal to
  E = 1's), steps (lockstep rounds: every rank runs one forward per round, an empty one where
  its replica is idle), empty_steps, kv_pages_per_rank, and per rank its `all_to_all` calls and MB
  beside `predicted_MB`: the bytes that follow from the routing that happened, counted apart
  from the collective (rows each rank sent to each other rank, recorded per MoE layer):
  rows sent x (hidden + 2 top_k) x 4 for the dispatch plus rows received x hidden x 4 for the
  combine.
- `tensor`: the same model at `--tp-size E`: per rank its tensor-group `all_reduce` calls and MB.
- `redundant` (E > 1): a copy of the model whose gate favours two experts; per-rank expert load
  (token-expert pairs computed) max/mean with the contiguous placement and with E redundant
  experts placed from routing counts recorded at E = 1 (a counts file, as `shardserve
  record-experts` writes), whether the tokens stayed the same, and the routing counts per layer
  and expert (token-expert pairs).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from shardserve.bench.runs import per_group
from shardserve.distributed.expert_placement import layer_counts, save_counts
from shardserve.sampling_params import SamplingParams

HOT = (0, 1)  # the experts the skewed gate favours


def moe_model(args: argparse.Namespace, path: str, skewed: bool = False) -> None:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         head_dim=args.hidden // args.heads, intermediate_size=args.intermediate,
                         moe_intermediate_size=args.intermediate // 4, num_experts=args.experts,
                         num_experts_per_tok=args.top_k, norm_topk_prob=True, max_position_embeddings=4096,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if skewed:  # a larger gate row wins top-k for about half the tokens (those on its positive side)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight[list(HOT)] *= 6.0
    model.save_pretrained(path)


def run(path: str, prompts: list[list[int]], args: argparse.Namespace, **layout) -> tuple[dict, list]:
    from shardserve.llm import LLM

    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    # One rank runs in this process (this benchmark counts bytes and loads, it times nothing).
    with LLM(path, dtype=args.dtype, page_size=args.page_size, kv_cache_memory=args.kv_cache_memory,
             show_progress=False, **layout) as llm:
        llm.generate([[1] * args.page_size * 2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        warm_ranks = llm.rank_reports()
        outs = llm.generate(prompts, params, use_tqdm=False)
        ranks = llm.rank_reports()
        pages = llm.limits.num_pages
    # Plans each rank ran: under lockstep every rank runs one per round, empty ones included.
    result = {"steps": ranks[0]["plans"] - warm_ranks[0]["plans"],
              "empty_steps": sum(a["empty_plans"] - b["empty_plans"] for a, b in zip(ranks, warm_ranks)
                                 if llm.layout.coords(a["rank"]).tp == 0),
              "kv_pages_per_rank": pages,
              "groups": [per_group(a, b) for a, b in zip(ranks, warm_ranks)],
              "experts": [_expert_delta(a.get("experts", {}), b.get("experts", {})) for a, b in zip(ranks, warm_ranks)]}
    # Tokens routed per layer, each once (the report's tensor rank 0 of each group).
    result["routed"] = layer_counts([{"rank": a["rank"], "experts": e} for a, e in zip(ranks, result["experts"])],
                                    llm.layout)
    return result, [o.token_ids for o in outs]


def _expert_delta(after: dict, before: dict) -> dict:
    """Per-layer counts of the timed run alone."""
    out = {}
    for key, layers in after.items():
        base = before.get(key, {})
        out[key] = {layer: _sub(v, base.get(layer)) for layer, v in layers.items()}
    return out


def _sub(v, base):
    if isinstance(v, list):
        return [a - b for a, b in zip(v, base or [0] * len(v))]
    return v - (base or 0)


def predicted_mb(experts: list[dict], hidden: int, top_k: int, itemsize: int = 4) -> list[float]:
    """Each rank's all-to-all bytes implied by the rows its dispatch sent to each rank."""
    n = len(experts)
    sent = [[sum(rows[d] for rows in e["rows_to"].values()) for d in range(n)] for e in experts]
    out = []
    for r in range(n):
        dispatch = sum(sent[r][d] for d in range(n) if d != r) * (hidden + 2 * top_k) * itemsize
        combine = sum(sent[s][r] for s in range(n) if s != r) * hidden * itemsize
        out.append(round((dispatch + combine) / 1e6, 6))
    return out


def load_ratio(experts: list[dict]) -> float:
    """max / mean over ranks of the token-expert pairs each rank's experts computed."""
    loads = [sum(e["computed"].values()) for e in experts]
    return round(max(loads) * len(loads) / sum(loads), 3) if sum(loads) else 0.0


def _ops(groups: list[dict], kind: str, op: str) -> list[dict]:
    return [g.get(kind, {}).get(op, {"calls": 0, "MB": 0.0}) for g in groups]


def run_expert(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        path, skewed = os.path.join(tmp, "moe"), os.path.join(tmp, "skewed")
        moe_model(args, path)
        moe_model(args, skewed, skewed=True)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(args.vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_prompts)]
        first = skew_first = counts_file = None
        for size in args.sizes:
            dpa = dict(tp_size=size, dp_size=size, enable_dp_attention=True) if size > 1 else {}
            rec, tokens = run(path, prompts, args, **dpa)
            first = first if first is not None else tokens
            a2a = _ops(rec["groups"], "expert", "all_to_all")
            print(json.dumps({"mode": "expert", "ranks": size, "same_tokens": tokens == first, "steps": rec["steps"],
                              "empty_steps": rec["empty_steps"], "kv_pages_per_rank": rec["kv_pages_per_rank"],
                              "all_to_all": a2a,
                              "predicted_MB": predicted_mb(rec["experts"], args.hidden, args.top_k) if size > 1
                              else [0.0],
                              "all_to_all_sizes": _ops(rec["groups"], "expert", "all_to_all_sizes")}), flush=True)
            if size > 1:
                trec, ttokens = run(path, prompts, args, tp_size=size)
                print(json.dumps({"mode": "tensor", "ranks": size, "same_tokens": ttokens == first,
                                  "all_reduce": _ops(trec["groups"], "tensor", "all_reduce")}), flush=True)
            srec, stokens = run(skewed, prompts, args, **dpa)
            skew_first = skew_first if skew_first is not None else stokens
            if size == 1:  # the warm-up run whose counts place the replicas
                counts_file = os.path.join(tmp, "counts.json")
                save_counts(counts_file, srec["routed"], args.experts, "skewed")
                continue
            rrec, rtokens = run(skewed, prompts, args, **dpa, ep_num_redundant_experts=size,
                                ep_expert_placement=counts_file)
            print(json.dumps({"mode": "redundant", "ranks": size, "redundant_experts": size,
                              "same_tokens": stokens == skew_first and rtokens == skew_first,
                              "load_max_over_mean": load_ratio(srec["experts"]),
                              "load_max_over_mean_with_replicas": load_ratio(rrec["experts"]),
                              "routed_per_layer": srec["routed"]}), flush=True)
    return 0
