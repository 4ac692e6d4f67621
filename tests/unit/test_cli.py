"""The command line: every numeric flag refused in one line before anything starts, help shows
defaults, parsing stays light, and the installed package is never shadowed by a clone."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from shardserve.cli.main import build_parser, main


@pytest.mark.parametrize("argv, message", [
    (["serve", "--port", "99999"], "argument --port: must be in [1, 65535], got 99999"),
    (["serve", "--port", "0"], "argument --port: must be in [1, 65535], got 0"),
    (["--port", "http"], "argument --port: expected an integer, got 'http'"),
    (["serve", "--num-tokenizers", "-1"], "argument --num-tokenizers: must be >= 0, got -1"),
    (["serve", "--max-n", "0"], "argument --max-n: must be >= 1, got 0"),
    (["serve", "--startup-timeout", "-5"], "argument --startup-timeout: must be > 0, got -5"),
    (["serve", "--dist-timeout", "nan"], "argument --dist-timeout: must be a number, got nan"),
    (["serve", "--kv-cache-memory", "0"], "argument --kv-cache-memory: must be > 0, got 0"),
    (["serve", "--seed", str(2**64)], f"argument --seed: must be in [{-(2**63)}, {2**63 - 1}], got {2**64}"),
    (["chat", "--temperature", "-1"], "argument --temperature: must be >= 0, got -1"),
    (["chat", "--max-tokens", "0"], "argument --max-tokens: must be >= 1, got 0"),
    (["bench", "offline", "--batch1-tokens", "-2"], "argument --batch1-tokens: must be >= 0, got -2"),
    (["bench", "dist", "--kv-cache-memory", "-1"], "argument --kv-cache-memory: must be > 0, got -1"),
    (["bench", "serve", "--url", "x", "--request-rate", "0"], "argument --request-rate: must be > 0, got 0"),
])
def test_bad_numbers_are_one_line_naming_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                yield from _subparsers(sub)


def _help_of(sub: argparse.ArgumentParser, action: argparse.Action) -> str:
    """One flag's help as --help prints it, defaults filled in, on one line."""
    return " ".join(sub._get_formatter()._expand_help(action).split()) if action.help is not None else ""


def test_help_shows_every_default():
    checked = 0
    for name, sub in _subparsers(build_parser()):
        text = " ".join(sub.format_help().split())
        for action in sub._actions:
            if "(default" in (action.help or ""):
                continue  # says its default in its own words (an environment variable, say)
            if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                shown = f"(default: {action.default})"
                assert shown in text, f"{name} {action.option_strings[0]}: {shown} missing from --help"
                checked += 1
    assert checked > 40


def test_help_states_no_default_twice():
    checked = 0
    for name, sub in _subparsers(build_parser()):
        sub.format_help()  # help text is filled in as the formatter meets each flag
        for action in sub._actions:
            if action.option_strings:
                text = _help_of(sub, action)
                assert text.count("(default") <= 1, f"{name} {action.option_strings[0]}: {text}"
                checked += 1
    assert checked > 60


def test_every_chat_flag_has_help():
    chat = dict(_subparsers(build_parser()))["chat"]
    temperature = next(a for a in chat._actions if "--temperature" in a.option_strings)
    assert _help_of(chat, temperature).startswith("sampling temperature, 0 = greedy (default: ")


def test_parsing_imports_no_server_or_model_machinery(tmp_path):
    code = ("import sys; from shardserve.cli.main import build_parser; build_parser(); "
            "print([m for m in ('transformers', 'fastapi', 'uvicorn', 'openai', 'zmq') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_clone_named_shardserve_does_not_shadow_the_package(tmp_path):
    # A script run from the parent of a clone called `shardserve`: that directory is on sys.path
    # first, and with a flat layout it would win as an empty namespace package.
    (tmp_path / "shardserve" / "tests").mkdir(parents=True)
    out = subprocess.run([sys.executable, "-c", "from shardserve import LLM, SamplingParams; print(LLM.__module__)"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={**os.environ, "PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "shardserve.llm"


def _refused(capsys, argv: list[str]) -> str:
    """Run `shardserve serve ARGV` in this process; it must stop before any worker starts, with
    exit code 2 and one line on stderr."""
    capsys.readouterr()  # not the fixtures' progress bars
    assert main(["serve", "--port", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardserve: error: ") and "Traceback" not in err, err
    return err.strip()


def test_max_model_len_beyond_the_model_is_refused(capsys, tiny_model):
    path, _ = tiny_model("llama")  # 512 positions
    assert _refused(capsys, ["--model", path, "--max-model-len", "100000"]) == (
        "shardserve: error: --max-model-len 100000 exceeds the model's context limit of 512 tokens "
        "(max_position_embeddings): give at most 512, or leave it out")


def test_kv_budget_below_one_page_says_the_page_size(capsys, tiny_model):
    path, _ = tiny_model("llama")  # a 16-token page: 2 layers x 2 KV heads x 16 dims x K, V x 4 bytes x 16
    assert _refused(capsys, ["--model", path, "--kv-cache-memory", "4K"]) == (
        "shardserve: error: --kv-cache-memory 4096 bytes holds no KV page: one page of 16 tokens takes 8192 bytes "
        "on a rank (K and V, all its layers), so give at least 8192 (8K), or a smaller --page-size")


def test_missing_model_path_says_it_does_not_exist(capsys, tmp_path):
    missing = str(tmp_path / "path/that/does/not/exist.gguf")
    assert _refused(capsys, ["--model", missing]) == f"shardserve: error: --model {missing}: no such file or directory"


def test_expert_parallel_on_a_dense_model_says_it_has_no_experts(capsys, tiny_model):
    path, _ = tiny_model("llama")
    assert _refused(capsys, ["--model", path, "--ep-size", "2"]) == (
        f"shardserve: error: --ep-size 2 needs a mixture-of-experts model; {os.path.basename(path)} has no experts "
        f"(it is dense: leave --ep-size out)")


@pytest.mark.parametrize("device, message", [
    ("cuda", "--device cuda: this torch ({}) is a CPU-only build; use --device cpu, or install a CUDA build of torch"),
    ("nonsense", "--device 'nonsense' is not a torch device (e.g. cpu, cuda, cuda:1)"),
])
def test_unusable_device_is_refused(capsys, tiny_model, device, message):
    import torch

    if device == "cuda" and torch.version.cuda is not None:
        pytest.skip("this torch is a CUDA build")
    path, _ = tiny_model("llama")
    assert _refused(capsys, ["--model", path, "--device", device]) == (
        "shardserve: error: " + message.format(torch.__version__))


@pytest.mark.parametrize("command", [["serve"], ["chat"], ["bench", "offline"], ["record-experts", "-o", "x.json"]])
def test_threads_and_log_level_reach_the_engine_config(command):
    from shardserve.cli.flags import engine_config

    args = build_parser().parse_args([*command, "--threads", "3", "--log-level", "warning"])
    cfg = engine_config(args)
    assert (args.log_level, cfg.threads, cfg.show_progress) == ("warning", 3, False)  # no load bar above info


def test_threads_set_each_ranks_omp_threads():
    from shardserve.config import EngineConfig
    from shardserve.distributed.layout import Layout
    from shardserve.launch.ranks import thread_env

    assert thread_env(EngineConfig(threads=3), Layout()) == {"OMP_NUM_THREADS": "3"}
    assert thread_env(EngineConfig(threads=3), Layout(tp=2)) == {"OMP_NUM_THREADS": "3"}
    assert thread_env(EngineConfig(), Layout()) is None  # one rank: torch's own choice, as before


def test_llm_in_process_takes_threads_and_log_level(tiny_model, caplog, monkeypatch):
    import logging

    import torch

    from shardserve.llm import LLM
    from shardserve.logs import LOG_LEVEL_ENV

    monkeypatch.setenv(LOG_LEVEL_ENV, "info")  # restored after the test, as are the threads and level below
    before, shardserve_log = torch.get_num_threads(), logging.getLogger("shardserve")
    try:
        with caplog.at_level(logging.INFO):
            LLM(tiny_model("llama")[0], threads=1, num_pages=8, log_level="info").shutdown()
        assert torch.get_num_threads() == 1
        assert "rank 0 of 1: device cpu, dtype float32" in caplog.text and "1 thread per rank" in caplog.text
        LLM(tiny_model("llama")[0], num_pages=8, log_level="error").shutdown()
        assert os.environ[LOG_LEVEL_ENV] == "error" and shardserve_log.level == logging.ERROR  # and its workers
    finally:
        torch.set_num_threads(before)
        shardserve_log.setLevel(logging.NOTSET)


def _traceback_of(error: BaseException) -> str:
    import traceback

    try:
        raise error
    except BaseException:
        return traceback.format_exc()


def test_a_worker_refusing_a_setting_is_one_line_a_fault_keeps_its_traceback():
    from shardserve.distributed.layout import LayoutError
    from shardserve.launch.process_tree import failure

    refused = failure("scheduler-1", _traceback_of(LayoutError("--tp-size 3 exceeds the model's 2 heads")))
    assert str(refused) == "scheduler-1 failed to start: --tp-size 3 exceeds the model's 2 heads"
    assert refused.exit_code == 2  # as a bad flag is
    fault = failure("scheduler-0", _traceback_of(KeyError("layers.0")))
    assert str(fault).startswith("scheduler-0 failed to start:\nTraceback") and "KeyError: 'layers.0'" in str(fault)
    assert fault.exit_code == 1


def test_async_scheduling_beside_a_pipeline_is_one_line(capsys, tiny_model):
    path, _ = tiny_model("llama")
    assert _refused(capsys, ["--model", path, "--async-scheduling", "--pp-size", "2"]) == (
        "shardserve: error: --async-scheduling needs --pp-size 1 and --cp-size 1 for now (got 2 and 1)")
    from shardserve.cli.flags import engine_config

    assert engine_config(build_parser().parse_args(["serve", "--async-scheduling"])).async_scheduling
