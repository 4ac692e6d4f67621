"""`shardserve env`: what a bug report needs to know about this machine and install.

Versions, the OS, the CPU and the instruction sets the C kernels can use, the C compiler, which
kernel libraries were built and load here (or why not, and what runs instead), the thread
settings, CUDA, and the collective backend. Loading the kernels builds them where the cache
lacks them, so the report shows what an engine started here would run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "transformers", "gguf", "llguidance", "numpy")
# The instruction sets the kernels' code paths (or the compiler's -march=native) can use.
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16",
             "amx_tile", "amx_bf16", "amx_int8")
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "KMP_AFFINITY")


def add_env_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty off Linux)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_report() -> dict[str, Any]:
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    return {"model": info.get("model name") or platform.processor() or platform.machine(),
            "machine": platform.machine(), "logical_cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "flags": {flag: flag in flags for flag in CPU_FLAGS} if flags else None}


def compiler_report() -> dict[str, Any]:
    from shardserve import native

    cc = native.compiler()
    if not cc[0]:
        return {"command": None, "version": None}
    try:
        out = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        version = out.splitlines()[0] if out else None
    except (OSError, subprocess.SubprocessError) as e:
        version = f"cannot run: {e}"
    return {"command": " ".join(cc), "version": version}


def kernel_report() -> list[dict[str, Any]]:
    """Each C library: its source, its cached build, whether it loads here, else why not."""
    from shardserve import native

    rows = []
    for lib in native.LIBRARIES:
        row: dict[str, Any] = {"name": lib.name, "provides": lib.provides, "source": str(lib.source),
                               "library": None, "was_cached": False, "loaded": False, "error": None, "fallback": None,
                               "paths": None}
        try:
            path = native.library_path(lib.source)
            row["library"], row["was_cached"] = str(path), path.exists()
            row["paths"] = native.kernel_paths(native.library(lib.name))
            row["loaded"] = True
        except native.KernelUnavailable as e:
            row["error"], row["fallback"] = str(e), lib.fallback
        rows.append(row)
    return rows


def threads_report() -> dict[str, Any]:
    import torch

    cpus = os.cpu_count() or 1
    # As the launcher shares a node's CPUs out (launch/ranks.py): one rank keeps torch's default.
    per_rank = {"1": torch.get_num_threads(), **{str(n): max(1, cpus // n) for n in (2, 4, 8)}}
    return {"torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
            "openmp": torch.backends.openmp.is_available(), "mkldnn": torch.backends.mkldnn.is_available(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "env": {var: os.environ.get(var) for var in THREAD_VARS}, "default_threads_per_rank": per_rank}


def accelerator_report() -> dict[str, Any]:
    import torch

    from shardserve.platform import collective_backend, pick_device

    cuda = torch.cuda.is_available()
    devices = []
    for i in range(torch.cuda.device_count() if cuda else 0):
        props = torch.cuda.get_device_properties(i)
        devices.append({"index": i, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                        "capability": f"{props.major}.{props.minor}"})
    dist = torch.distributed.is_available()
    return {"cuda_available": cuda, "torch_cuda": torch.version.cuda, "devices": devices,
            "default_device": str(pick_device()), "collective_backend": collective_backend(pick_device()),
            "nccl_available": dist and torch.distributed.is_nccl_available(),
            "gloo_available": dist and torch.distributed.is_gloo_available()}


def collect() -> dict[str, Any]:
    import shardserve
    from shardserve import native

    # shardserve's own version is the imported module's: the installed metadata may be another copy's.
    versions = {"python": sys.version.split()[0], "shardserve": shardserve.__version__}
    return {"versions": versions | {name: _version(name) for name in PACKAGES},
            "shardserve_path": str(Path(shardserve.__file__).parent),
            "os": {"platform": platform.platform(), "libc": " ".join(platform.libc_ver()).strip() or None},
            "cpu": cpu_report(), "compiler": compiler_report(), "kernel_cache": str(native.cache_dir()),
            "kernels": kernel_report(),
            "threads": threads_report(), "accelerators": accelerator_report()}


def _kernel_line(row: dict[str, Any]) -> str:
    if row["loaded"]:
        how = "cached" if row["was_cached"] else "built now"
        return (f"C kernels ({row['provides']}): in use, {row['library']} ({how}; from {Path(row['source']).name}); "
                f"runs on {row['paths']}")
    return f"C kernels ({row['provides']}): NOT AVAILABLE ({row['error']}); instead {row['fallback']}"


def render(report: dict[str, Any]) -> str:
    """The report as `key: value` lines, for a terminal or a bug report."""
    v, cpu, th, acc = report["versions"], report["cpu"], report["threads"], report["accelerators"]
    flags = cpu["flags"]
    lines = [f"shardserve: {v['shardserve']} at {report['shardserve_path']}",
             "versions: " + ", ".join(f"{name} {version or 'not installed'}" for name, version in v.items()),
             f"os: {report['os']['platform']} ({report['os']['libc'] or 'libc unknown'})",
             f"cpu: {cpu['model']} ({cpu['machine']}, {cpu['usable_cpus']} of {cpu['logical_cpus']} CPUs usable)",
             "cpu flags: " + ("unknown (no /proc/cpuinfo)" if flags is None else
                              " ".join(f if on else f"-{f}" for f, on in flags.items()) + "  (-: absent)"),
             f"compiler: {report['compiler']['command'] or 'none'} ({report['compiler']['version'] or 'no version'})"]
    lines += [f"kernel cache: {report['kernel_cache']}", *(_kernel_line(row) for row in report["kernels"])]
    env = ", ".join(f"{k}={val}" for k, val in th["env"].items() if val is not None) or "none set"
    per_rank = ", ".join(f"{n} ranks: {t}" for n, t in th["default_threads_per_rank"].items())
    lines += [f"threads: torch {th['torch_threads']} (interop {th['torch_interop_threads']}), "
              f"OpenMP {th['openmp']}, oneDNN {th['mkldnn']}, torch's CPU kernels {th['torch_cpu_capability']}; "
              f"thread variables: {env}",
              f"default threads per rank, by ranks on a node: {per_rank}"]
    devices = "; ".join(f"cuda:{d['index']} {d['name']} {d['memory_gib']} GiB sm {d['capability']}"
                        for d in acc["devices"]) or "none"
    lines += [f"cuda: available {acc['cuda_available']} (torch built for CUDA {acc['torch_cuda'] or 'none'}), "
              f"devices: {devices}",
              f"collective backend: {acc['collective_backend']} on {acc['default_device']} "
              f"(nccl available {acc['nccl_available']}, gloo available {acc['gloo_available']})"]
    return "\n".join(lines)


def run_env(args: argparse.Namespace) -> int:
    """Prints the report (as JSON with --json); 0, since a report of a broken install is the point."""
    report = collect()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0
