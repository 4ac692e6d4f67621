"""Ranks are processes started as commands: a plain script may build LLM(tp_size=2) at top level,
with no main guard, and leave no process behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

SCRIPT = """
from shardserve import LLM, SamplingParams
llm = LLM({path!r}, tp_size=2, num_pages=32, show_progress=False)
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
print("TOKENS", out[0].outputs[0].token_ids)
"""


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append(int(entry))
    return out


def test_top_level_script_without_main_guard(tiny_model, tmp_path):
    path, model = tiny_model("llama")
    script = tmp_path / "generate.py"
    script.write_text(SCRIPT.format(path=path))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    with torch.no_grad():
        ref = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert f"TOKENS {ref[0, 3:].tolist()}" in out
    deadline = time.monotonic() + 5
    while session_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session_members(proc.pid) == []
