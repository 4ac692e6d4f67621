"""One engine's speed on one device, for scripts/gpu_check.sh: a random Llama-3.2-1B-shaped model
(or a tiny one, to check this script on a CPU) in the engine's default dtype; offline throughput,
batch-1 decode against the bandwidth floor (weight bytes / measured copy bandwidth), and GPU
kernel launches per decode step; then the same runs under --async-scheduling. Prints one JSON
object."""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=301, tie_word_embeddings=True),
}


def write_model(shape: str, device: torch.device, path: str) -> None:
    cfg = LlamaConfig(max_position_embeddings=4096, torch_dtype="bfloat16", **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second a device copy moves (read + write), best of five."""
    x = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t = time.perf_counter()
        y.copy_(x)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(core, prompts: list[list[int]], max_tokens: int, outputs: list | None = None) -> tuple[int, float]:
    """(output tokens, seconds); each request's tokens appended to `outputs` if given."""
    from shardserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    reqs = [core.add_request(f"r{i}-{time.monotonic_ns()}", p, params) for i, p in enumerate(prompts)]
    t = time.perf_counter()
    while core.has_unfinished():
        core.step()
    if outputs is not None:
        outputs.extend(r.output_token_ids for r in reqs)
    return sum(len(r.output_token_ids) for r in reqs), time.perf_counter() - t


def measure(core, prompts: list[list[int]], tokens: int, outputs: list) -> tuple[float, float]:
    """Offline output tokens/s over `prompts`, and one stream's decode seconds per token."""
    run(core, prompts[:2], 4)  # warm-up: Triton compiles its kernels
    done, seconds = run(core, prompts, tokens, outputs)
    one, one_s = run(core, prompts[:1], tokens)
    _, prefill_s = run(core, prompts[:1], 1)
    return done / seconds, (one_s - prefill_s) / max(1, one - 1)


def async_scheduling(cfg, prompts: list[list[int]], tokens: int, sync_outputs: list) -> dict:
    """The same runs under --async-scheduling (a fresh engine), and how many requests' greedy
    tokens match the synchronous run's (a GPU's products may round otherwise when the batch
    differs, as it does for the one extra step of a finished request)."""
    from dataclasses import replace

    from shardserve.scheduler.engine_core import EngineCore

    core = EngineCore(replace(cfg, async_scheduling=True))
    try:
        outputs: list = []
        rate, decode_s = measure(core, prompts, tokens, outputs)
    finally:
        core.close()
    same = sum(a == b for a, b in zip(outputs, sync_outputs))
    return {"async_offline_output_tokens_per_s": round(rate, 1),
            "async_batch1_decode_tokens_per_s": round(1 / decode_s, 1),
            "async_same_tokens": f"{same}/{len(outputs)}"}


def kernel_launches(core, device: torch.device) -> int | None:
    """GPU kernels one decode step of one running request launches (None on the CPU)."""
    if device.type != "cuda":
        return None
    from shardserve.sampling_params import SamplingParams

    core.add_request("launches", [1] * 16, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    core.step()  # the prefill
    core.step()  # one decode, warm
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        core.step()
        _sync(device)
    while core.has_unfinished():
        core.step()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    from shardserve.config import EngineConfig
    from shardserve.scheduler.engine_core import EngineCore

    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as path:
        write_model(args.shape, device, path)
        cfg = EngineConfig(model=path, device=args.device, show_progress=False, kv_cache_memory=0.5)
        core = EngineCore(cfg)
        g = torch.Generator().manual_seed(0)
        vocab = SHAPES[args.shape]["vocab_size"]
        prompts = [torch.randint(vocab, (int(n),), generator=g).tolist()
                   for n in torch.randint(32, 512, (args.requests,), generator=g)]
        outputs: list = []
        rate, decode_s = measure(core, prompts, args.tokens, outputs)
        weights = int(core.runner.weight_mb * 1e6)  # each tensor once, packed or not
        floor_s = weights / copy_bandwidth(device)
        result = {
            "device": str(device), "shape": args.shape, "dtype": core.cfg.dtype,
            "attention": core.runner.attention.describe(), "weight_bytes": weights,
            "offline_output_tokens_per_s": round(rate, 1),
            "batch1_decode_tokens_per_s": round(1 / decode_s, 1),
            "bandwidth_floor_tokens_per_s": round(1 / floor_s, 1),
            "batch1_fraction_of_floor": round(floor_s / decode_s, 3),
            "kernel_launches_per_decode_step": kernel_launches(core, device),
        }
        del core  # its KV pool, before the next engine sizes its own
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result.update(async_scheduling(cfg, prompts, args.tokens, outputs))
        print(json.dumps(result))


if __name__ == "__main__":
    main()
