"""The prepared GPU check (run by scripts/gpu_check.sh; docs/gpu.md says what it measures).

Each stage runs as its own process under a time limit, so one that hangs or dies is reported and
the rest still run; without CUDA every GPU stage is reported skipped and a CPU run of the bench
script checks its logic. Writes results.json under the output folder."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def stage(name: str, cmd: list[str], limit_s: int, results: dict, env: dict | None = None) -> str:
    print(f"[gpu_check] {name}: {' '.join(cmd)} (limit {limit_s} s)", flush=True)
    t = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit_s,
                              env={**os.environ, **(env or {})})
        status = "passed" if done.returncode == 0 else f"failed (exit {done.returncode})"
        out = done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        status, out = f"timed out after {limit_s} s", (e.stdout or b"").decode() + (e.stderr or b"").decode()
    results[name] = {"status": status, "seconds": round(time.monotonic() - t, 1), "tail": out[-3000:]}
    print(f"[gpu_check] {name}: {status}", flush=True)
    return out


def last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    results: dict = {"environment": {
        "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if cuda else None, "devices": torch.cuda.device_count()}}
    py = sys.executable
    skipped = {"status": "skipped: no CUDA device"}
    if cuda:
        stage("cuda_tests", [py, "-m", "pytest", "-q", "-m", "cuda", "tests/cuda"], 240, results)
        text = stage("bench_1b_bf16", [py, "scripts/gpu_bench.py", "--device", "cuda", "--shape", "1b"], 180,
                     results)
        results["bench_1b_bf16"]["result"] = last_json(text)
    else:
        results["cuda_tests"] = results["bench_1b_bf16"] = skipped
        text = stage("bench_logic_on_cpu", [py, "scripts/gpu_bench.py", "--device", "cpu", "--shape", "tiny",
                                            "--requests", "4", "--tokens", "8"], 120, results)
        results["bench_logic_on_cpu"]["result"] = last_json(text)
    results["layouts_on_one_gpu"] = {"status": "skipped: not built (NCCL takes one GPU per rank; gloo over CUDA "
                                               "tensors is not wired in distributed/groups.py)"}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"[gpu_check] wrote {out / 'results.json'}")
    failed = [k for k, v in results.items() if str(v.get("status", "passed")).startswith(("failed", "timed"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
