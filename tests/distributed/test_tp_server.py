"""The server at --tp-size 2 --cp-size 2 and --tp-size 3: openai client answers equal
transformers'; killing one rank ends the server with an error naming it, and leaves no process
behind."""

from __future__ import annotations

import os
import re
import sys

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from server_util import Server  # noqa: E402


# The server's path at TP 2 x CP 2 (flags to layout to ranks); every architecture and size runs
# offline in test_tensor_parallel.py and test_context_parallel.py, and the TP 3 MoE server below
# (CI time keeps this to one more case).
@pytest.mark.parametrize("arch,flags", [("llama", ["--tp-size", "2", "--cp-size", "2"])], ids=["llama-tp2-cp2"])
def test_tp_server_matches_transformers(tiny_model, tmp_path, arch, flags):
    path, model = tiny_model(arch)
    server = Server("--model", path, *flags, "--num-pages", "64", "--page-size", "8", log_path=str(tmp_path / "log"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        tok = AutoTokenizer.from_pretrained(path)
        prompt = "The capital of France is"
        r = client.completions.create(model=None, prompt=prompt, max_tokens=12, temperature=0)
        ids = tok.encode(prompt)
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert r.choices[0].text == tok.decode(ref[0, len(ids):].tolist(), skip_special_tokens=True)
    finally:
        code, left = server.stop()
    assert code == 0 and left == []
    with open(tmp_path / "log") as f:
        assert "rank 3 (cp 1, tp 1)" in f.read()  # the flags made the grid


def test_tp3_server_matches_transformers_and_dies_whole(tiny_model, tmp_path):
    path, model = tiny_model("qwen3_moe")
    server = Server("--model", path, "--tp-size", "3", "--num-pages", "64", "--page-size", "8",
                    log_path=str(tmp_path / "log"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        batch = [[5, 6, 7], [100, 200, 33, 44, 55, 66, 77, 88, 99]]
        tok = AutoTokenizer.from_pretrained(path)
        r = client.completions.create(model=None, prompt=batch, max_tokens=16, temperature=0)
        for choice, ids in zip(r.choices, batch):
            with torch.no_grad():
                ref = model.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
            assert choice.text == tok.decode(ref[0, len(ids):].tolist(), skip_special_tokens=True)
        metrics = httpx.get(server.url + "/metrics").text
        calls = float(re.search(r'shardserve_comm_calls\{op="all_reduce"\} (\S+)', metrics).group(1))
        assert calls > 0

        # A long request in flight, then rank 1 dies.
        assert server.kill_mid_request("scheduler-1") < 30
    finally:
        code, left = server.stop()
    assert code != 0 and left == []
    assert "scheduler-1 (tp 1) was killed by signal 9" in server.read_log(), server.read_log()[-4000:]

