"""`shardserve bench offline --compare vllm` against the real vLLM CPU backend, on 3 tiny requests.

Needs vLLM's own venv (bash /work/shared/peers/vllm_cpu.sh, ~3.5 GB), which CI does not
install: skipped without it. The model is a tiny random Llama with 64-dimensional heads (vLLM's
CPU attention takes no smaller ones), saved as a Hugging Face directory.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from tiny_tokenizer import save_tiny_tokenizer
from transformers import AutoModelForCausalLM, LlamaConfig

from shardserve.bench.vllm_peer import DEFAULT_PYTHON
from shardserve.cli.main import main

VLLM_PYTHON = os.environ.get("VLLM_PYTHON") or DEFAULT_PYTHON
pytestmark = pytest.mark.skipif(not os.path.exists(VLLM_PYTHON),
                                reason=f"vLLM's venv not installed ({VLLM_PYTHON}; bash /work/shared/peers/"
                                       "vllm_cpu.sh installs it, ~3.5 GB, not in CI)")


@pytest.fixture(scope="module")
def llama64(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("llama64"))
    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=301, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # wide logits, so greedy ties cannot flip between two fp32 engines (as conftest)
        for name, p in model.named_parameters():
            if "norm" not in name and p.dim() > 1:
                p.mul_(4.0)
    model.save_pretrained(path)
    save_tiny_tokenizer(path, cfg.vocab_size)
    return path


def test_compare_vllm(llama64, capsys):
    rc = main(["bench", "offline", "--model", llama64, "--compare", "vllm", "--vllm-python", VLLM_PYTHON,
               "--num-requests", "3", "--min-prompt", "8", "--max-prompt", "24", "--min-output", "4",
               "--max-output", "8", "--batch1-tokens", "0", "--threads", "1", "--vllm-kv-cache-space", "1",
               "--vllm-enforce-eager"])  # (a start without torch.compile: the harness is what is tested)
    assert rc == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["vllm"]["output_tokens"] == result["ours"]["output_tokens"]  # ignore_eos, min_tokens: exact
    assert result["vllm"]["output_tps"] > 0 and result["ratio_output_tps"] > 0
    assert result["greedy_match"] == {"equal": 3, "compared": 3}
    assert "greedy tokens equal to vLLM's (first 4 requests): 3/3" in out
    assert result["vllm"]["eager"] and "(vLLM eager: --vllm-enforce-eager)" in out
