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


def test_bench_batch1_alternates_dtypes_and_takes_each_rounds_ratio(tiny_model, capsys):
    path, _ = tiny_model("llama")
    rc = main(["bench", "batch1", "--model", path, "--dtypes", "bfloat16,float32", "--tokens", "6", "--rounds", "2"])
    assert rc == 0
    out = capsys.readouterr().out
    rounds = re.findall(r"round (\d): bfloat16 ([\d.]+) tok/s, float32 ([\d.]+) tok/s; bfloat16 / float32 ([\d.]+)x",
                        out)
    assert [r[0] for r in rounds] == ["1", "2"]
    for _, bf, f32, ratio in rounds:  # each round's ratio is its own two runs'
        assert abs(float(bf) / float(f32) - float(ratio)) < 0.01
    res = json.loads(out.strip().splitlines()[-1])
    assert res["rounds"] == 2 and set(res["decode_tps"]) == {"bfloat16", "float32"}
    assert res["bfloat16_over"]["float32"] > 0


def test_bench_batch1_refuses_bad_dtype_lists(capsys):
    for bad in ("bfloat16,bfloat16", "auto", "int4", ","):
        try:
            main(["bench", "batch1", "--model", "x", "--dtypes", bad])
        except SystemExit as e:
            assert e.code == 2
        assert "--dtypes: expected distinct dtypes" in capsys.readouterr().err


def test_bench_offline_sampled_runs_are_seeded_and_not_greedy(tiny_model, capsys):
    """--temperature 1: each request seeded by its position, so two runs make the same tokens,
    and they are not the greedy ones."""
    from shardserve.bench.offline import make_workload, run_ours
    from shardserve.llm import LLM

    path, _ = tiny_model("llama")
    llm = LLM(model=path)
    args = type("A", (), dict(num_requests=6, min_prompt=8, max_prompt=24, min_output=12, max_output=12,
                              workload_seed=0))()
    wl = make_workload(args, llm.limits.vocab_size)
    sampling = {"temperature": 1.0, "top_p": 0.95}
    first, again, greedy = (run_ours(llm, wl, sampling=s)[1] for s in (sampling, sampling, None))
    assert first == again and first != greedy
    assert [len(t) for t in first] == wl.output_lens


def test_bench_offline_and_serve_refuse_bad_sampling_flags(capsys):
    for argv, why in ((["offline", "--top-p", "0"], "--top-p must be in (0, 1]"),
                      (["offline", "--temperature", "-1"], "--temperature must be >= 0"),
                      (["serve", "--url", "http://127.0.0.1:9", "--top-k", "0"], "--top-k must be -1 (off) or >= 1"),
                      (["offline", "--temperature", "1", "--compare", "transformers"], "runs greedy only")):
        try:
            main(["bench", *argv])
            raise AssertionError(f"{argv} was not refused")
        except SystemExit as e:
            assert why in str(e.code), e.code
