"""Where the C kernels cannot be had, the process says so once, in one warning that names what
falls back to torch and why; every caller still gets its torch path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import shardserve

# Touches every caller of the C libraries, twice, checks each took its torch path, then asks
# the env report.
SCRIPT = """
import logging
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
import torch
from shardserve.attention import cpu_kernel
from shardserve.layers import cpu_ops, kernels, quant_kernel
for _ in range(2):
    assert quant_kernel.available() is not None
    assert quant_kernel.float_weight(torch.randn(4, 16)) is None
    assert cpu_ops.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6) is None
    assert cpu_ops.silu_mul(torch.randn(2, 8)) is None
    assert kernels.load_or_none() is None
    try:
        cpu_kernel.load()
    except cpu_kernel.KernelUnavailable:
        pass
    else:
        raise AssertionError("the attention kernel loaded without a compiler")
from shardserve.cli import env as env_report
rows = env_report.kernel_report()  # `shardserve env` says why, without a second warning
assert all(not r["loaded"] and r["error"] and r["fallback"] for r in rows), rows
print("fell back")
"""


def run_without_kernels(cc: str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, CC=cc, SHARDSERVE_CACHE=str(cache),
               PYTHONPATH=str(Path(shardserve.__file__).parents[1]))
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("cc, reason", [("/nonexistent/cc", "cannot run the C compiler '/nonexistent/cc'"),
                                        ("false", "false failed on")])
def test_one_warning_names_what_falls_back_and_why(tmp_path, cc, reason):
    proc = run_without_kernels(cc, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "fell back"
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, proc.stderr
    line = warnings[0]
    assert reason in line
    for what in ("quantized GGUF products", "decode loop", "fused CPU ops", "paged decode attention"):
        assert what in line
    assert "slower" in line
    assert not list((tmp_path / "kernels").glob("*.so"))
