"""`shardserve env` (run_env): reports this machine's C kernels as in use and its CPU flags as
/proc/cpuinfo lists them, as text and as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardserve import native
from shardserve.cli import env as env_report
from shardserve.cli.main import main


def run(capsys, *argv: str) -> str:
    """`shardserve env ARGV` through the command line's own dispatcher."""
    assert main(["env", *argv]) == 0
    return capsys.readouterr().out


def cpuinfo_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text()
    return set(next(line for line in text.splitlines() if line.startswith("flags")).partition(":")[2].split())


def test_json_reports_the_kernels_in_use(capsys):
    report = json.loads(run(capsys, "--json"))
    kernels = {row["name"]: row for row in report["kernels"]}
    assert set(kernels) == {lib.name for lib in native.LIBRARIES}
    for row in kernels.values():
        assert row["loaded"] and row["error"] is None, row
        assert Path(row["library"]).is_file() and Path(row["library"]).parent == native.cache_dir()
    assert report["kernel_cache"] == str(native.cache_dir())
    assert report["versions"]["torch"] and report["versions"]["shardserve"]
    assert report["compiler"]["command"] == " ".join(native.compiler())
    assert report["accelerators"]["collective_backend"] in ("gloo", "nccl")
    assert report["threads"]["torch_threads"] >= 1


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads /proc/cpuinfo")
def test_cpu_flags_match_proc_cpuinfo(capsys):
    flags = json.loads(run(capsys, "--json"))["cpu"]["flags"]
    have = cpuinfo_flags()
    assert flags == {flag: flag in have for flag in env_report.CPU_FLAGS}


def test_text_report(capsys):
    out = run(capsys)
    kernel_lines = [line for line in out.splitlines() if line.startswith("C kernels (")]
    assert len(kernel_lines) == len(native.LIBRARIES)
    assert all(": in use, " in line for line in kernel_lines)
    assert "paged decode attention" in out and "quantized GGUF products" in out
    if Path("/proc/cpuinfo").exists():
        flags_line = next(line for line in out.splitlines() if line.startswith("cpu flags: "))
        words = flags_line.removeprefix("cpu flags: ").split()
        have = cpuinfo_flags()
        assert [f for f in env_report.CPU_FLAGS if f in have] == [w for w in words if w in env_report.CPU_FLAGS]
    assert "collective backend: " in out and "default threads per rank" in out


def test_kernel_paths_follow_this_cpus_flags(capsys):
    """The kernels are compiled for the host, so the instructions they report are the CPU's own:
    AVX-512 with VNNI where it has them, AVX-VNNI or plain AVX2 otherwise."""
    kernels = {row["name"]: row for row in json.loads(run(capsys, "--json"))["kernels"]}
    flags, layers = cpuinfo_flags(), kernels["layers"]["paths"]
    if {"avx512f", "avx512bw"} <= flags:
        want = "avx512 vnni (vpdpwssd zmm)" if "avx512_vnni" in flags else "avx512 (vpmaddwd zmm)"
    elif {"avx2", "f16c"} <= flags:
        want = "avx2 avx-vnni (vpdpwssd ymm)" if "avx_vnni" in flags else "avx2 (vpmaddwd ymm)"
    else:
        want = "scalar"
    assert f"x16 groups on {want};" in layers
    bf16 = "avx512_bf16" in flags  # vdpbf16ps: bfloat16 products and a bfloat16 KV cache
    assert ("bfloat16: x16 groups on avx512-bf16 vdpbf16ps" in layers or "bfloat16: amx tiles" in layers) == bf16
    attention = kernels["attention"]["paths"]
    assert attention.startswith("16 float lanes (avx512);" if "avx512f" in flags else "8 float lanes;")
    amx = "bfloat16: amx tiles" in layers  # attention takes AMX where the products do (csrc/amx.h)
    want = ("bfloat16 KV cache: scores and values on amx tiles (probabilities rounded to bfloat16; pages of "
            "whole 16s of tokens), else avx512-bf16 vdpbf16ps" if amx
            else "bfloat16 KV cache on avx512-bf16 vdpbf16ps" if bf16 else "float32 KV cache only (no AVX512-BF16)")
    assert attention.endswith(want)
