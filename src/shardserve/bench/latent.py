"""`shardserve bench dist --mode latent`: a DeepSeek-shaped model (latent attention, DeepSeekMoE)
on 4 ranks (`--sizes`' largest), under tensor parallelism and under data-parallel attention with
expert parallelism, with the same `--kv-cache-memory` per rank.

Under tensor parallelism every rank caches every token's whole latent (it is one head, it cannot
split), so the server holds one rank's pool worth of tokens; under data-parallel attention each
rank caches only its own replica's tokens, so the server holds one pool per rank. One JSON line
per layout: kv_bytes_per_token_per_rank (what one served token costs each rank that holds it),
kv_tokens_per_rank and server_kv_tokens (from the pools the ranks built), the workload's
preemptions and steps (8 prompts x 64 tokens + 16 new against those pools), all-to-all and
all-reduce MB per step per rank, same_tokens (equal to one rank's); then a `compare` line with
the ratio of tokens admitted per rank, and what the same model's K/V would cost per token per
rank at TP 4 with multi-head attention (heads split, no duplication) for scale. Last, `decode_cost`
lines: one layer's decode attention for one token at contexts 16 to 8192, with the up-projections
absorbed (the engine's way) against decompressing the cached latents' K and V each step
(DeepSeek-V2-Lite's attention shape, torch ops on this process's threads).

The model: `--layers` (default 4), `--hidden` 512, `--heads` 8, kv_lora_rank 128, rotary 32,
nope 64, v 64, q_lora_rank 192, 8 routed experts in 2 groups, top 2, one shared, the first layer
dense; fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from shardserve.bench.runs import per_group
from shardserve.sampling_params import SamplingParams

LATENT = dict(kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, q_lora_rank=192)


def latent_model(args: argparse.Namespace, path: str) -> None:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                           num_attention_heads=args.heads, num_key_value_heads=args.heads,
                           intermediate_size=args.intermediate, moe_intermediate_size=args.intermediate // 4,
                           n_routed_experts=args.experts, num_experts_per_tok=args.top_k, n_group=2, topk_group=1,
                           n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=4096,
                           bos_token_id=None, eos_token_id=None, pad_token_id=None, **LATENT)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)


def _per_step(ops: dict, steps: int) -> float:
    return round(ops.get("MB", 0.0) / max(steps, 1), 4)


def run_layout(path: str, prompts: list[list[int]], args: argparse.Namespace, **layout) -> tuple[dict, list]:
    from shardserve.llm import LLM

    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    with LLM(path, dtype=args.dtype, page_size=args.page_size, kv_cache_memory=args.kv_cache_memory,
             show_progress=False, **layout) as llm:
        llm.generate([[1] * args.page_size * 2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        warm, warm_ranks = llm.stats(), llm.rank_reports()
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats, ranks = llm.stats(), llm.rank_reports()
        pages, replicas, size = llm.limits.num_pages, llm.layout.dp, llm.layout.world
    groups = [per_group(a, b) for a, b in zip(ranks, warm_ranks)]
    steps = ranks[0]["plans"] - warm_ranks[0]["plans"]
    tokens_per_pool = pages * args.page_size
    record = {"ranks": size, "replicas": replicas, "kv_pages_per_rank": pages,
              "kv_tokens_per_rank": tokens_per_pool * replicas // size, "server_kv_tokens": tokens_per_pool * replicas,
              "preemptions": stats.preemptions - warm.preemptions, "steps": steps,
              "all_to_all_MB_per_step": [_per_step(g.get("expert", {}).get("all_to_all", {}), steps) for g in groups],
              "all_reduce_MB_per_step": [_per_step(g.get("tensor", {}).get("all_reduce", {}), steps) for g in groups]}
    return record, [o.token_ids for o in outs]


# DeepSeek-V2-Lite's attention shape, for the decode cost lines.
LITE = dict(heads=16, lora=512, rope=64, nope=128, v=128)


def _best_ms(fn, repeats: int = 5) -> float:
    import time

    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return round(best * 1e3, 3)


def decode_cost(context: int) -> dict:
    """One layer's attention for one decoding token over `context` cached latents, V2-Lite's
    shape, fp32: absorbed (the engine's way: the query through W_uk, attention over the latent,
    W_uv after) against decompressing every cached token's K and V through kv_b_proj each step."""
    h, lora, rope, nope, v = (LITE[k] for k in ("heads", "lora", "rope", "nope", "v"))
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(context, lora + rope, generator=g)
    w_uk, w_uv = torch.randn(h, nope, lora, generator=g) / lora**0.5, torch.randn(h, v, lora, generator=g) / lora**0.5
    q_nope, q_rope = torch.randn(h, 1, nope, generator=g), torch.randn(h, rope, generator=g)
    scale = (nope + rope) ** -0.5

    def absorbed():
        q = torch.cat((torch.bmm(q_nope, w_uk)[:, 0], q_rope), dim=-1)  # [h, lora + rope]
        p = torch.softmax(q @ cache.T * scale, dim=-1)  # [h, L]
        return torch.bmm((p @ cache[:, :lora]).unsqueeze(1), w_uv.transpose(1, 2))  # [h, 1, v]

    def decompressed():
        latent = cache[:, :lora]
        k = torch.cat((torch.einsum("lc,hnc->hln", latent, w_uk),
                       cache[:, lora:].expand(h, -1, -1)), dim=-1)  # [h, L, nope + rope]
        vals = torch.einsum("lc,hvc->hlv", latent, w_uv)  # [h, L, v]
        q = torch.cat((q_nope[:, 0], q_rope), dim=-1).unsqueeze(1)  # [h, 1, nope + rope]
        p = torch.softmax(torch.bmm(q, k.transpose(1, 2)) * scale, dim=-1)
        return torch.bmm(p, vals)

    torch.testing.assert_close(absorbed(), decompressed(), rtol=1e-3, atol=1e-3)  # the same attention
    a, d = _best_ms(absorbed), _best_ms(decompressed)
    return {"mode": "latent", "layout": "decode_cost", "context": context, "threads": torch.get_num_threads(),
            "absorbed_ms": a, "decompressed_ms": d, "decompressed_over_absorbed": round(d / a, 2)}


def run_latent(args: argparse.Namespace) -> int:
    from shardserve.model_config import ModelConfig

    size = max(args.sizes)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "deepseek")
        latent_model(args, path)
        mc = ModelConfig.from_dir(path)
        itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
        per_token = mc.kv_values_per_token(1, mc.num_layers) * itemsize
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(args.vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_prompts)]
        one, first = run_layout(path, prompts, args)
        records = {}
        for name, layout in (("tensor", dict(tp_size=size)),
                             ("dp_attention", dict(tp_size=size, dp_size=size, enable_dp_attention=True))):
            rec, tokens = run_layout(path, prompts, args, **layout)
            rec = {"mode": "latent", "layout": name, "same_tokens": tokens == first,
                   "kv_bytes_per_token_per_rank": per_token, **rec}
            records[name] = rec
            print(json.dumps(rec), flush=True)
    head = LATENT["qk_nope_head_dim"] + LATENT["qk_rope_head_dim"] + LATENT["v_head_dim"]  # one head's K and V
    mha = mc.num_layers * mc.num_heads * head * itemsize // size
    print(json.dumps({"mode": "latent", "layout": "compare", "ranks": size,
                      "tokens_per_rank_dp_attention_over_tensor":
                          round(records["dp_attention"]["kv_tokens_per_rank"]
                                / records["tensor"]["kv_tokens_per_rank"], 2),
                      "latent_bytes_per_token": per_token,
                      "mha_kv_bytes_per_token_per_rank_at_tp": mha,
                      "one_rank_preemptions": one["preemptions"]}), flush=True)
    for context in (16, 128, 1024, 8192):
        print(json.dumps(decode_cost(context)), flush=True)
    return 0
