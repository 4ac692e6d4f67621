"""`shardserve bench soak`, short: mixed traffic on two replicas with ranks killed at random; the
run itself checks that every request was answered once (equal to its warm-up reference) or
failed cleanly, and that nothing was left over once idle."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_short_soak_with_kills_loses_nothing(tiny_model):
    path, _ = tiny_model("llama")
    spawn = f"--model {path} --dp-size 2 --num-pages 128 --page-size 8"
    run = subprocess.run([sys.executable, "-m", "shardserve", "bench", "soak", "--spawn", spawn, "--duration", "14",
                          "--warmup", "3", "--kill-every", "4", "--clients", "3", "--max-rss-growth", "0.5"],
                         capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    print(run.stdout)
    assert run.returncode == 0 and "soak: PASSED" in run.stdout, out[-4000:]
    kills = int(re.search(r"replica kills (\d+)", run.stdout).group(1))
    assert kills >= 2, out[-3000:]
    rows = {line.split()[0]: [int(x) for x in line.split()[1:]] for line in run.stdout.splitlines()
            if line.split() and line.split()[0] in ("completion", "chat-stream", "bad-body", "disconnect")}
    assert rows["completion"][0] > 0 and rows["chat-stream"][0] > 0  # answers
    assert rows["bad-body"][3] > 0 and rows["disconnect"][2] > 0  # refusals, the client's own disconnects


def test_a_server_that_fails_to_start_is_one_line(tmp_path):
    """The spawned server's own error, in one line, not a traceback; exit status 1."""
    missing = tmp_path / "missing"
    run = subprocess.run([sys.executable, "-m", "shardserve", "bench", "soak", "--spawn", f"--model {missing}",
                          "--duration", "1"], capture_output=True, text=True, timeout=120)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert last.startswith("shardserve bench: the server exited with 2 before it was healthy: ")
    assert f"--model {missing}: no such file or directory" in last
