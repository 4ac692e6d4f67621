"""What `shardserve serve` says while it starts: the settings in force, once, from the rank that
decided them; progress as each slow step begins; nothing but warnings under --log-level warning;
a rank refusing a setting in one line."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

from server_util import Server, free_port


def _started(tiny_model, tmp_path, *flags: str) -> str:
    """The log of a tiny server started with `flags`, once it is healthy and stopped again."""
    path, _ = tiny_model("llama")  # 2 layers, 2 KV heads of 16 dims, 512 positions
    server = Server("--model", path, *flags, log_path=str(tmp_path / "server.log"))
    code, left = server.stop()
    log = server.read_log()
    assert code == 0 and left == [], log[-3000:]
    return log


def test_startup_log_says_the_settings_in_force(tiny_model, tmp_path):
    log = _started(tiny_model, tmp_path, "--num-pages", "64", "--page-size", "8", "--threads", "1")
    lines = [line for line in log.splitlines() if "[scheduler-0]" in line and "rank 0 of 1: device" in line]
    assert len(lines) == 1, log[-3000:]  # once, from rank 0, which names itself
    summary = lines[0]
    assert re.search(r"device (cpu|cuda:0), dtype float32, quantization none \(float32 weights\), ", summary)
    assert "1 thread per rank" in summary  # --threads reached the rank (torch would take every core)
    # 8 tokens x 2 layers x 2 KV heads x 16 dims x K and V x 4 bytes = 4096 bytes a page
    assert "KV cache float32, 64 pages x 8 tokens (512 tokens), 0.2 MiB on this rank (4096 bytes a page)" in summary
    assert summary.endswith("context length 512 tokens (the model's limit)")
    for step in ("starting 1 scheduler rank (tp 1 x pp 1 x dp 1 x cp 1) and 2 other workers",
                 "rank 0 of 1: loading the tokenizer and the model ...",
                 "rank 0: building the LlamaForCausalLM model (2 layers here) on ",
                 "rank 0: loading 21 tensors of "):
        assert step in log, step


def test_context_length_below_the_models_says_where_it_comes_from(tiny_model, tmp_path):
    log = _started(tiny_model, tmp_path, "--num-pages", "64", "--max-model-len", "300")
    assert "context length 300 tokens (--max-model-len; the model's is 512)" in log, log[-3000:]


def test_log_level_warning_silences_the_info_lines(tiny_model, tmp_path):
    log = _started(tiny_model, tmp_path, "--num-pages", "64", "--log-level", "warning")
    # Not the launcher's, the ranks' and tokenizers', uvicorn's, nor the weights' progress bar.
    assert "INFO" not in log and "Loading" not in log, log[-3000:]


def test_kv_fraction_below_one_page_is_one_line_from_the_rank(tiny_model):
    path, _ = tiny_model("llama")
    proc = subprocess.run([sys.executable, "-m", "shardserve", "serve", "--model", path, "--port", str(free_port()),
                           "--kv-cache-memory", "1e-15"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("shardserve: error: ")]
    assert len(errors) == 1 and re.fullmatch(
        r"shardserve: error: scheduler-0 failed to start: --kv-cache-memory 1e-15 of free memory \(\d+ bytes\) holds "
        r"no KV page: one page of 16 tokens takes 8192 bytes on a rank \(K and V, all its layers\), so give at least "
        r"8192 \(8K\), or a smaller --page-size", errors[0]), errors


def test_a_damaged_tokenizer_is_one_line_naming_its_folder(tiny_model, tmp_path):
    src, _ = tiny_model("llama")
    path = tmp_path / "damaged"
    shutil.copytree(src, path)
    (path / "tokenizer.json").write_text("{ damaged")
    proc = subprocess.run([sys.executable, "-m", "shardserve", "serve", "--model", str(path), "--port",
                           str(free_port())], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("shardserve: error: ")]
    assert len(errors) == 1 and re.fullmatch(
        rf"shardserve: error: \S+ failed to start: the tokenizer in {re.escape(str(path))} does not load: "
        r"JSONDecodeError: .*", errors[0]), errors
