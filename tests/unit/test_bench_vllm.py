"""`shardserve bench offline --compare vllm` without vLLM: the refusals, the driver's pure
functions, and the whole path through a fake `vllm` package standing in for vLLM's venv."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import stat
import sys

import pytest

from shardserve.bench import vllm_peer
from shardserve.cli.main import main


def load_driver():
    """vllm_driver.py by path, as vLLM's interpreter runs it (not as part of shardserve)."""
    spec = importlib.util.spec_from_file_location("vllm_driver_under_test", vllm_peer.DRIVER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FAKE_VLLM = '''
import json, os
__version__ = "fake-0"

class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw

class _Completion:
    def __init__(self, ids):
        self.token_ids = ids

class _Output:
    def __init__(self, ids):
        self.outputs = [_Completion(ids)]

def _log(entry):
    with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\\n")

class LLM:
    def __init__(self, **kw):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError("no CPU backend here")
        _log({"llm": kw, "env": {k: os.environ.get(k) for k in
              ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}})

    def generate(self, prompts, params, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
        _log({"generate": [sp.kw for sp in params]})
        return [_Output([p["prompt_token_ids"][0]] * sp.kw["max_tokens"]) for p, sp in zip(prompts, params)]
'''


@pytest.fixture
def fake_vllm_python(tmp_path, monkeypatch):
    """An executable standing in for vLLM's python: ours, with a fake `vllm` on its path."""
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "inputs.py").write_text("TokensPrompt = dict\n")
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "site"} exec {sys.executable} "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "fake.log"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    return str(exe), log


def test_gguf_model_refused(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(SystemExit) as e:
        main(["bench", "offline", "--model", str(gguf), "--compare", "vllm"])
    msg = str(e.value)
    assert "\n" not in msg and "Hugging Face" in msg and "smollm2_hf.py" in msg and str(gguf) in msg


def test_dtype_and_device_refused(tiny_model):
    path, _ = tiny_model("llama")
    with pytest.raises(SystemExit, match="bfloat16 or float32"):
        main(["bench", "offline", "--model", path, "--compare", "vllm", "--dtype", "float16"])
    with pytest.raises(SystemExit, match="--device cpu"):
        main(["bench", "offline", "--model", path, "--compare", "vllm", "--device", "meta"])


def test_missing_python(tiny_model, tmp_path, monkeypatch):
    path, _ = tiny_model("llama")
    missing = str(tmp_path / "nope" / "python")
    with pytest.raises(SystemExit) as e:
        main(["bench", "offline", "--model", path, "--compare", "vllm", "--vllm-python", missing])
    msg = str(e.value)
    assert "\n" not in msg and f"no vLLM python at {missing}" in msg and "vllm_cpu.sh" in msg
    monkeypatch.setenv("VLLM_PYTHON", missing)  # the default's first choice
    with pytest.raises(SystemExit, match=re.escape(missing)):
        vllm_peer.find_vllm_python(None)
    monkeypatch.delenv("VLLM_PYTHON")
    assert vllm_peer.find_vllm_python(sys.executable) == sys.executable


def test_cpu_list_and_env():
    assert vllm_peer.cpu_list(3, {0, 1, 2, 5}) == "0-2"
    assert vllm_peer.cpu_list(3, {0, 1, 4}) == "0-1,4"
    assert vllm_peer.cpu_list(1, {0, 1}) == "0"
    env = vllm_peer.vllm_env(2, 4, {"PATH": "/bin", "PYTHONPATH": "/ours"})
    assert env["PATH"] == "/bin" and "PYTHONPATH" not in env
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == vllm_peer.cpu_list(2)


def test_driver_is_standalone():
    """The driver runs in vLLM's venv: stdlib imports only at module level, nothing from shardserve."""
    source = open(vllm_peer.DRIVER).read()
    tree = ast.parse(source)

    def modules(nodes):
        return ({a.name.split(".")[0] for n in nodes if isinstance(n, ast.Import) for a in n.names}
                | {n.module.split(".")[0] for n in nodes if isinstance(n, ast.ImportFrom)})

    assert modules(tree.body) <= {"__future__", "argparse", "json", "sys", "time"}, modules(tree.body)
    assert modules(ast.walk(tree)) - modules(tree.body) == {"vllm"}  # inside run() only
    assert 'if __name__ == "__main__":' in source


def test_workload_round_trip(tmp_path):
    drv = load_driver()
    spec = vllm_peer.workload_spec("/m", "bfloat16", [[5, 6, 7], [8]], [3, 1], None, 7)
    path = tmp_path / "w.json"
    path.write_text(json.dumps(spec))
    assert drv.read_workload(str(path)) == spec
    assert drv.llm_kwargs(spec) == {"model": "/m", "dtype": "bfloat16", "seed": 7}
    assert drv.llm_kwargs(spec | {"max_model_len": 64})["max_model_len"] == 64
    assert drv.sampling_kwargs(5) == {"temperature": 0.0, "max_tokens": 5, "min_tokens": 5, "ignore_eos": True,
                                      "detokenize": False}
    args = drv.parse_args(["in.json", "out.json"])
    assert (args.workload, args.result) == ("in.json", "out.json")
    with pytest.raises(SystemExit):
        drv.parse_args(["only-one"])
    out = drv.summarize(spec, [[1, 2, 3], [4]], 2.0, 9.0, "x")
    drv.write_result(str(tmp_path / "r.json"), out)
    assert json.loads((tmp_path / "r.json").read_text())["output_tokens"] == 4
    assert vllm_peer.vllm_stats(out)["output_tps"] == 2.0


@pytest.mark.parametrize("bad, why", [
    ({"dtype": "float16"}, "vLLM's CPU backend runs"),
    ({"output_lens": [3]}, "2 prompts but 1 output lengths"),
    ({"prompts": [[1], []]}, "non-empty list of token ids"),
    ({"output_lens": [3, 0]}, "positive integer"),
])
def test_workload_checked(bad, why):
    drv = load_driver()
    with pytest.raises(ValueError, match=re.escape(why)):
        drv.check_workload(vllm_peer.workload_spec("/m", "float32", [[1], [2]], [3, 1], None, 0) | bad)
    with pytest.raises(ValueError, match="lacks model"):
        drv.check_workload({"dtype": "float32", "prompts": [], "output_lens": []})


def test_driver_failure_is_one_line(fake_vllm_python, monkeypatch):
    exe, _ = fake_vllm_python
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    spec = vllm_peer.workload_spec("/m", "float32", [[1, 2]], [2], None, 0)
    with pytest.raises(SystemExit) as e:
        vllm_peer.run_driver(exe, spec, dict(os.environ))
    msg = str(e.value)
    assert "\n" not in msg and "vLLM failed" in msg and "exit 1" in msg
    assert msg.endswith("RuntimeError: no CPU backend here")


def test_compare_through_fake_vllm(tiny_model, fake_vllm_python, capsys):
    path, _ = tiny_model("llama")
    exe, log = fake_vllm_python
    rc = main(["bench", "offline", "--model", path, "--num-requests", "5", "--max-prompt", "40", "--max-output", "20",
               "--compare", "vllm", "--vllm-python", exe, "--vllm-kv-cache-space", "3", "--batch1-tokens", "0",
               "--threads", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0]["llm"] == {"model": os.path.abspath(path), "dtype": "float32", "seed": 0}
    assert calls[0]["env"] == {"VLLM_CPU_OMP_THREADS_BIND": vllm_peer.cpu_list(1), "VLLM_CPU_KVCACHE_SPACE": "3"}
    timed = calls[2]["generate"]  # calls[1] is the warm-up
    assert len(timed) == 5 and all(sp["temperature"] == 0 and sp["ignore_eos"] for sp in timed)
    assert all(sp["min_tokens"] == sp["max_tokens"] for sp in timed)
    assert result["vllm"]["output_tokens"] == result["ours"]["output_tokens"] == sum(sp["max_tokens"] for sp in timed)
    assert result["vllm"]["version"] == "fake-0" and result["ratio_output_tps"] > 0
    assert result["greedy_match"]["compared"] == 4  # the fake's tokens are not the model's
    assert re.search(r"^\s+shardserve\s+vLLM$", out, re.M)
    assert re.search(r"^TTFT mean \(s\)\*\s+[\d.]+\s+-$", out, re.M)
    assert "generate() alone, after its start-up and a warm-up" in out
    assert "output tokens/s ratio ours/vLLM" in out and "greedy tokens equal to vLLM's (first 4 requests)" in out


def test_sampled_compare_sends_the_same_sampling_to_vllm(tiny_model, fake_vllm_python, capsys):
    """--temperature/--top-p/--top-k: every request of both engines samples so (vLLM's unseeded:
    its CPU sampler fails on a request's seed); no greedy comparison of tokens is claimed."""
    path, _ = tiny_model("llama")
    exe, log = fake_vllm_python
    rc = main(["bench", "offline", "--model", path, "--num-requests", "3", "--min-prompt", "8", "--max-prompt", "30",
               "--min-output", "4", "--max-output", "10", "--compare", "vllm", "--vllm-python", exe,
               "--batch1-tokens", "0", "--threads", "1", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20"])
    assert rc == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    timed = [json.loads(line) for line in log.read_text().splitlines()][2]["generate"]
    assert [(sp["temperature"], sp["top_p"], sp["top_k"]) for sp in timed] == [(0.8, 0.9, 20)] * 3
    assert "min_p" not in timed[0] and "seed" not in timed[0]  # flags left off are not sent
    assert "greedy_match" not in result and "greedy tokens equal" not in out
    assert "temperature 0.8, top_p 0.9, top_k 20" in out


def test_sampling_kwargs_take_the_workload_sampling():
    drv = load_driver()
    assert drv.sampling_kwargs(4, {"temperature": 0.7, "min_p": 0.1}) == {
        "temperature": 0.7, "min_p": 0.1, "max_tokens": 4, "min_tokens": 4, "ignore_eos": True, "detokenize": False}
    with pytest.raises(ValueError, match="unknown fields \\['top_a'\\]"):
        drv.check_workload(vllm_peer.workload_spec("/m", "float32", [[1]], [2], None, 0, {"top_a": 1}))
