"""Started by torchrun, each process takes its rank from the environment instead of starting
children: the server at TP 2 under `torchrun --nproc-per-node 2` gives TP 1's tokens."""

from __future__ import annotations

import os
import re
import signal
import sys

import openai
import pytest
from test_multinode import Node, no_node_outlives_its_test  # noqa: F401  (the fixture: cleanup)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from server_util import free_port  # noqa: E402

pytestmark = pytest.mark.slow


def test_server_under_torchrun(tiny_model, tmp_path):
    path, _ = tiny_model("llama")
    port, master = free_port(), free_port()
    # A master port whose +2 and +3 (the plan feed, the results inbox) are free: --standalone
    # draws one from the ephemeral range, where another process may hold them.
    run = Node(["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(master),
                "-m", "shardserve", "serve", "--model", path, "--tp-size", "2", "--num-pages", "64", "--port",
                str(port)], str(tmp_path / "torchrun.log"), module="torch.distributed.run")
    run.wait_for(f"serving {os.path.basename(path)} on http://127.0.0.1:{port}", timeout=180)
    log = run.read()
    assert "scheduler-1 ready (torchrun rank 1 of 2)" in log
    assert "started scheduler-1" not in log  # rank 1 is torchrun's process, not our child
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    got = client.completions.create(model=None, prompt=[5, 6, 7], max_tokens=12, temperature=0).choices[0].text
    run.proc.send_signal(signal.SIGINT)  # Ctrl-C: torchrun passes it on to every rank
    _, left = run.finish(60)  # torchrun's own exit on a signal is 1, with its SignalException
    assert left == [], run.read()[-3000:]
    log = run.read()
    assert "shutting down: 0 requests in flight cut off" in log and "Finished server process" in log
    assert re.findall(r'File "[^"]*shardserve[^"]*"', log) == []  # no traceback through our code

    from shardserve import LLM, SamplingParams

    with LLM(path, num_pages=64, show_progress=False) as one:
        want = one.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0].text
    assert got == want
