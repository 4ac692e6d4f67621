"""`shardserve bench offline --compare transformers` on a tiny random Llama."""

from __future__ import annotations

import json
import re

from shardserve.cli.main import main


def test_bench_offline_compare(tiny_model, capsys):
    path, _ = tiny_model("llama")
    rc = main(["bench", "offline", "--model", path, "--num-requests", "4", "--max-prompt", "40",
               "--max-output", "20", "--compare", "transformers", "--hf-batch-size", "2", "--batch1-tokens", "8"])
    assert rc == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    for engine in ("ours", "transformers"):
        assert all(v > 0 for v in result[engine].values()), result[engine]
    assert result["ratio_output_tps"] > 0
    assert all(result["batch1"][k] > 0 for k in ("ours_decode_tps", "transformers_decode_tps", "ratio"))
    assert result["greedy_match"] == {"equal": 4, "compared": 4}
    assert result["attention"].startswith("cpu") and "attention cpu" in out
    assert re.search(r"greedy tokens equal to transformers' .*: 4/4", out)


def test_bench_offline_json_schema(tiny_model, capsys):
    """--json-schema: the same workload with every output held to a schema, and the slowdown."""
    path, _ = tiny_model("llama")
    rc = main(["bench", "offline", "--model", path, "--num-requests", "4", "--max-prompt", "40", "--max-output", "20",
               "--batch1-tokens", "8", "--json-schema"])
    assert rc == 0
    out = capsys.readouterr().out
    res = json.loads(out.strip().splitlines()[-1])["json_schema"]
    assert len(res["output_tps_off_on"]) == len(res["batch1_decode_tps_off_on"]) == 3
    assert res["ratio_output_tps"] > 0 and res["batch1_ratio"] > 0
    assert re.search(r"with a JSON schema: output tokens/s .* \(on/off\), median ratio", out)
