"""The tokenizer's class is chosen by AutoTokenizer once per checkpoint's files and remembered:
later loads give the same tokenizer without AutoTokenizer, and without importing torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import Future

import pytest
from transformers import AutoTokenizer

from shardserve.config import EngineConfig
from shardserve.loader import tokenizer_class as tokenizer_module
from shardserve.loader.model_path import default_model_path
from shardserve.loader.tokenizer_class import auto_tokenizer
from shardserve.sampling_params import SamplingParams
from shardserve.scheduler.engine_core import EngineCore

MESSAGES = [{"role": "user", "content": "hello there"}]


def _same(a, b) -> None:
    assert type(a) is type(b)
    for text in ("hello world", " a  b\nc", "<|im_start|>x"):
        assert a.encode(text) == b.encode(text)
        assert a.decode(a.encode(text)) == b.decode(b.encode(text))
    ids = list(range(len(a)))
    assert a.convert_ids_to_tokens(ids) == b.convert_ids_to_tokens(ids)
    assert (a.special_tokens_map, a.eos_token_id, a.chat_template) == (b.special_tokens_map, b.eos_token_id,
                                                                      b.chat_template)


def _counting(monkeypatch) -> list[str]:
    """AutoTokenizer.from_pretrained's calls from now on (the paths it was given)."""
    calls, real = [], AutoTokenizer.from_pretrained

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", counted)
    return calls


def _copy_tokenizer(src: str, dst, config: dict | None = None, **tokenizer_config) -> str:
    os.makedirs(dst)
    for name in os.listdir(src):
        if "tokenizer" in name or name == "config.json":
            shutil.copy(os.path.join(src, name), dst)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    if tokenizer_config:
        saved = json.loads((dst / "tokenizer_config.json").read_text())
        (dst / "tokenizer_config.json").write_text(json.dumps(saved | tokenizer_config))
    return str(dst)


def _entries(cache) -> list[str]:
    where = cache / "tokenizer-classes"
    return sorted(p.name for p in where.iterdir()) if where.exists() else []


def test_second_load_skips_auto_tokenizer_and_gives_the_same(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDSERVE_CACHE", str(tmp_path / "cache"))
    path = tiny_model("llama")[0]
    first = auto_tokenizer(path)
    _same(first, AutoTokenizer.from_pretrained(path))
    [entry] = _entries(tmp_path / "cache")

    def refused(*args, **kwargs):
        raise AssertionError("AutoTokenizer chose the class again despite the cache")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refused)
    _same(auto_tokenizer(path), first)
    assert _entries(tmp_path / "cache") == [entry]


def test_changed_files_or_a_damaged_entry_choose_again(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDSERVE_CACHE", str(tmp_path / "cache"))
    path = _copy_tokenizer(tiny_model("llama")[0], tmp_path / "ckpt")
    auto_tokenizer(path)
    [entry] = _entries(tmp_path / "cache")
    (tmp_path / "cache" / "tokenizer-classes" / entry).write_text("{ not json")
    calls = _counting(monkeypatch)
    _same(auto_tokenizer(path), auto_tokenizer(path))  # damaged: chosen again (once) and rewritten
    assert calls == [path]
    saved = json.loads((tmp_path / "cache" / "tokenizer-classes" / entry).read_text())
    assert saved == {"module": "transformers.tokenization_utils_tokenizers", "name": "TokenizersBackend"}
    config = json.loads((tmp_path / "ckpt" / "tokenizer_config.json").read_text())
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text(json.dumps(config | {"model_max_length": 77}))
    assert auto_tokenizer(path).model_max_length == 77
    assert len(calls) == 2 and len(_entries(tmp_path / "cache")) == 2  # the file changed: chosen again


def test_an_entry_naming_a_module_outside_transformers_is_not_followed(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDSERVE_CACHE", str(tmp_path / "cache"))
    path = tiny_model("llama")[0]
    auto_tokenizer(path)
    [entry] = _entries(tmp_path / "cache")
    (tmp_path / "cache" / "tokenizer-classes" / entry).write_text(json.dumps({"module": "collections",
                                                                               "name": "OrderedDict"}))
    calls = _counting(monkeypatch)
    assert type(auto_tokenizer(path)).__name__ == "TokenizersBackend" and calls == [path]


def test_the_class_chosen_by_the_files_and_by_the_path_as_given(tiny_model, tmp_path, monkeypatch):
    """AutoTokenizer takes the class tokenizer_config.json names (GPT2Tokenizer here) except for
    paths named like some Hub repositories (TokenizersBackend): the same directory, reached by a
    relative path of that form and by its absolute path, gets each its own class."""
    monkeypatch.setenv("SHARDSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    absolute = _copy_tokenizer(tiny_model("llama")[0], tmp_path / "deepseek-ai" / "deepseek-coder-x",
                               config={"model_type": "gpt2"}, tokenizer_class="GPT2Tokenizer")
    relative = "deepseek-ai/deepseek-coder-x"
    want = {p: type(AutoTokenizer.from_pretrained(p)).__name__ for p in (absolute, relative)}
    assert want == {absolute: "GPT2Tokenizer", relative: "TokenizersBackend"}
    for p in (absolute, relative, absolute, relative):
        assert type(auto_tokenizer(p)).__name__ == want[p], p
    calls = _counting(monkeypatch)
    for p in (absolute, relative):
        _same(auto_tokenizer(p), AutoTokenizer.from_pretrained(p))
    assert calls == [absolute, relative]  # only the comparisons' own: both remembered


def test_remote_code_is_not_remembered(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDSERVE_CACHE", str(tmp_path / "cache"))
    remote = type("RemoteTokenizer", (), {"__module__": "transformers_modules.someone.tok"})
    tokenizer_module.remember_class(str(tmp_path), remote)
    mapped = _copy_tokenizer(tiny_model("llama")[0], tmp_path / "mapped",
                             auto_map={"AutoTokenizer": [None, "tok.RemoteTokenizer"]})
    tokenizer_module.remember_class(mapped, AutoTokenizer.from_pretrained(tiny_model("llama")[0]).__class__)
    assert _entries(tmp_path / "cache") == []


def test_an_unwritable_cache_is_said_and_the_tokenizer_still_loads(tiny_model, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SHARDSERVE_CACHE", str(blocker))
    path = tiny_model("llama")[0]
    with caplog.at_level("WARNING", logger="shardserve.loader.tokenizer_class"):
        _same(auto_tokenizer(path), AutoTokenizer.from_pretrained(path))
    assert "cannot remember the tokenizer's class" in caplog.text


@pytest.mark.parametrize("which", ["hf", "gguf"])
def test_a_tokenizer_process_imports_no_torch(which, tiny_model, tmp_path):
    """What the tokenizer workers and the detokenizer pay at each start: the tokenizer alone.
    The GGUF on the machine's own cache (its converted tokenizer is there after a first start):
    the first run fills what it lacks."""
    path = tiny_model("llama")[0] if which == "hf" else default_model_path()
    code = ("import sys; from shardserve.loader.model_path import resolve_checkpoint; "
            "from shardserve.loader.tokenizer import load_tokenizer; "
            f"ckpt = resolve_checkpoint({path!r}); tok = load_tokenizer(ckpt); "
            "from shardserve.tokenizer.image_prompt import image_prompt; image_prompt(tok, ckpt); "
            "print(type(tok).__name__, len(tok), 'torch' in sys.modules)")
    env = dict(os.environ, SHARDSERVE_CACHE=str(tmp_path / "cache")) if which == "hf" else None
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    first, second = (r.stdout.split() for r in runs)
    assert second[:2] == first[:2] and second[2] == "False"


def test_the_engine_takes_its_tokenizer_as_a_future(tiny_model):
    """The leader loads its tokenizer beside the model (scheduler/process.py): the engine awaits
    it once built; stop strings then match in its text, and its failure is the engine's."""
    path = tiny_model("llama")[0]
    cfg = EngineConfig(model=path, show_progress=False, num_pages=32)
    ready: Future = Future()
    ready.set_result(auto_tokenizer(path))
    core = EngineCore(cfg, tokenizer=ready)
    free = core.add_request("free", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8))
    while core.has_unfinished():
        core.step()
    text = ready.result().decode(free.output_token_ids, skip_special_tokens=True)
    stop = text[len(text) // 2:][:2]
    assert stop.strip(), text
    req = core.add_request("stopped", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, stop=[stop]))
    while core.has_unfinished():
        core.step()
    assert req.finish_reason == "stop" and req.stop_reason == stop
    assert len(req.output_token_ids) < len(free.output_token_ids)
    failed: Future = Future()
    failed.set_exception(ValueError("tokenizer.json: not a tokenizer"))
    with pytest.raises(ValueError, match="not a tokenizer"):
        EngineCore(cfg, tokenizer=failed)
