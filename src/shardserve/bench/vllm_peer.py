"""`shardserve bench offline --compare vllm`: the same workload through vLLM's CPU backend.

vLLM lives in its own virtual environment (it pins its own torch), so it is never imported
here: its interpreter (`--vllm-python`, else $VLLM_PYTHON, else DEFAULT_PYTHON; installed by
/work/shared/peers/vllm_cpu.sh) runs vllm_driver.py on the workload written as JSON, and the
driver writes back its wall time and generated token ids. Only vLLM's `generate` is timed, after
its start-up and a warm-up, as `run_ours` times ours. vLLM gets our thread count as
VLLM_CPU_OMP_THREADS_BIND (the first `threads` CPUs this process may use) and a KV cache of
--vllm-kv-cache-space GiB (VLLM_CPU_KVCACHE_SPACE). vLLM reads Hugging Face directories only: a
GGUF --model is refused (/work/shared/peers/smollm2_hf.py writes the default SmolLM2 as one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from shardserve.loader.model_path import resolve_checkpoint

DEFAULT_PYTHON = "/tmp/peers/vllm/bin/python"
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_driver.py")
DTYPES = ("bfloat16", "float32")  # what vLLM's CPU backend runs
TIMEOUT_S = 1800
STDERR_LINES = 3  # of a failed run's stderr, in the error
WHO = "shardserve bench offline --compare vllm"
HF_HINT = ("pass a Hugging Face checkpoint directory (python /work/shared/peers/smollm2_hf.py OUT_DIR writes "
           "the default SmolLM2 as one)")


def find_vllm_python(given: str | None) -> str:
    """--vllm-python, else $VLLM_PYTHON, else DEFAULT_PYTHON; SystemExit if it is not an executable."""
    path = given or os.environ.get("VLLM_PYTHON") or DEFAULT_PYTHON
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise SystemExit(f"{WHO}: no vLLM python at {path} (install it with bash /work/shared/peers/vllm_cpu.sh, "
                         "or pass --vllm-python PATH or set VLLM_PYTHON)")
    return path


def check_model(model: str | None, dtype: str) -> str:
    """The HF checkpoint directory vLLM will load; SystemExit for a GGUF or a dtype vLLM CPU lacks."""
    ckpt = resolve_checkpoint(model)
    if ckpt.is_gguf:
        raise SystemExit(f"{WHO}: vLLM reads Hugging Face directories only, not the GGUF {ckpt.path}: {HF_HINT}")
    if dtype not in DTYPES:
        raise SystemExit(f"{WHO}: --dtype {dtype}: vLLM's CPU backend runs {' or '.join(DTYPES)}")
    return os.path.abspath(ckpt.path)


def check_vllm_compare(args) -> str:
    """Before anything loads: the model, dtype and device vLLM can take, and its interpreter's path."""
    from shardserve.platform import pick_device

    check_model(args.model, args.dtype)
    if pick_device(args.device).type != "cpu":
        raise SystemExit(f"{WHO}: vLLM runs on the CPU here; pass --device cpu so both engines do")
    return find_vllm_python(args.vllm_python)


def cpu_list(threads: int, allowed: set[int] | None = None) -> str:
    """The first `threads` CPUs of `allowed` (default: this process's affinity) as vLLM's bind
    list, e.g. '0-3' or '0-1,4'."""
    cpus = sorted(allowed if allowed is not None else os.sched_getaffinity(0))[:threads]
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def vllm_env(threads: int, kv_gib: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The driver's environment: ours, less PYTHONPATH (ours is not vLLM's), plus vLLM's CPU
    settings."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k != "PYTHONPATH"}
    env |= {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(threads), "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
    return env


def workload_spec(model_dir: str, dtype: str, prompts: list[list[int]], output_lens: list[int],
                  max_model_len: int | None, seed: int, sampling: dict | None = None) -> dict:
    """The driver's WORKLOAD JSON (see vllm_driver.py)."""
    return {"model": model_dir, "dtype": dtype, "prompts": prompts, "output_lens": output_lens,
            "max_model_len": max_model_len, "seed": seed, "sampling": sampling or {"temperature": 0.0}}


def tail(text: str, lines: int = STDERR_LINES) -> str:
    """The last non-blank lines of `text`, on one line."""
    return " | ".join([s.strip() for s in text.splitlines() if s.strip()][-lines:]) or "(no output)"


def run_driver(python: str, spec: dict, env: dict[str, str], timeout: float = TIMEOUT_S) -> dict:
    """Run vllm_driver.py under `python` on `spec`; its RESULT JSON, or SystemExit with the end of
    its stderr."""
    with tempfile.TemporaryDirectory(prefix="shardserve-vllm-") as d:
        work, out = os.path.join(d, "workload.json"), os.path.join(d, "result.json")
        with open(work, "w") as f:
            json.dump(spec, f)
        try:
            proc = subprocess.run([python, DRIVER, work, out], env=env, capture_output=True, text=True,
                                  timeout=timeout, cwd=d)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"{WHO}: vLLM ({python}) did not finish within {timeout:.0f} s") from None
        if proc.returncode != 0 or not os.path.exists(out):
            raise SystemExit(f"{WHO}: vLLM failed ({python}, exit {proc.returncode}): "
                             f"{tail(proc.stderr or proc.stdout)}")
        with open(out) as f:
            return json.load(f)


def vllm_stats(res: dict) -> dict:
    """The table's numbers: throughputs over generate()'s wall time; no TTFT (generate returns
    every request at once)."""
    wall = res["wall_s"]
    return {"wall_s": wall, "startup_s": res["startup_s"], "eager": res.get("eager", False),
            "prompt_tokens": res["prompt_tokens"],
            "output_tokens": res["output_tokens"], "output_tps": res["output_tokens"] / wall,
            "total_tps": (res["prompt_tokens"] + res["output_tokens"]) / wall,
            "version": res.get("vllm_version", "?")}


def run_vllm_compare(args, python: str, prompts: list[list[int]], output_lens: list[int],
                     threads: int, sampling: dict | None = None) -> tuple[dict, list[list[int]]]:
    """vLLM's stats for the workload, and each request's generated token ids."""
    spec = workload_spec(check_model(args.model, args.dtype), args.dtype, prompts, output_lens,
                         args.max_model_len, args.seed, sampling)
    spec["enforce_eager"] = bool(getattr(args, "vllm_enforce_eager", False))
    env = vllm_env(threads, args.vllm_kv_cache_space)
    print(f"running vLLM ({python}, VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}, "
          f"VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']}"
          f"{', enforce_eager' if spec['enforce_eager'] else ''})...", file=sys.stderr, flush=True)
    res = run_driver(python, spec, env)
    if len(res["tokens"]) != len(prompts):
        raise SystemExit(f"{WHO}: vLLM returned {len(res['tokens'])} outputs for {len(prompts)} requests")
    return vllm_stats(res), res["tokens"]
