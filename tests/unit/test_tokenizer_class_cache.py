"""The tokenizer's class is chosen by AutoTokenizer once per checkpoint's files and remembered:
later loads give the same tokenizer without AutoTokenizer, and without importing torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from shardserve.loader import tokenizer as tokenizer_module
from shardserve.loader.model_path import default_model_path
from shardserve.loader.tokenizer import auto_tokenizer

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
    src = tiny_model("llama")[0]
    path = tmp_path / "ckpt"
    path.mkdir()
    for name in os.listdir(src):
        if "tokenizer" in name or name == "config.json":
            (path / name).write_bytes((open(os.path.join(src, name), "rb")).read())
    auto_tokenizer(str(path))
    [entry] = _entries(tmp_path / "cache")
    (tmp_path / "cache" / "tokenizer-classes" / entry).write_text("{ not json")
    calls = []
    real = AutoTokenizer.from_pretrained

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", counted)
    _same(auto_tokenizer(str(path)), real(str(path)))  # damaged: chosen again and rewritten
    assert calls == [str(path)]
    saved = json.loads((tmp_path / "cache" / "tokenizer-classes" / entry).read_text())
    assert saved == {"module": "transformers.tokenization_utils_tokenizers", "name": "TokenizersBackend"}
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"model_max_length": 77}))
    assert auto_tokenizer(str(path)).model_max_length == 77  # the files changed: a new entry
    assert len(calls) == 2 and len(_entries(tmp_path / "cache")) == 2


def test_remote_code_classes_are_not_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDSERVE_CACHE", str(tmp_path / "cache"))
    remote = type("RemoteTokenizer", (), {"__module__": "transformers_modules.someone.tok"})
    tokenizer_module._remember(tmp_path / "cache" / "tokenizer-classes" / "x.json", remote, str(tmp_path))
    assert _entries(tmp_path / "cache") == []


def test_an_unwritable_cache_is_said_and_the_tokenizer_still_loads(tiny_model, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SHARDSERVE_CACHE", str(blocker))
    path = tiny_model("llama")[0]
    with caplog.at_level("WARNING", logger="shardserve.loader.tokenizer"):
        _same(auto_tokenizer(path), AutoTokenizer.from_pretrained(path))
    assert "cannot remember the tokenizer's class" in caplog.text


@pytest.mark.parametrize("which", ["hf", "gguf"])
def test_a_tokenizer_process_imports_no_torch(which, tiny_model):
    """What the tokenizer workers and the detokenizer pay at each start: the tokenizer alone.
    The machine's own cache (a GGUF's converted tokenizer is there after its first start): the
    first run fills what it lacks."""
    path = tiny_model("llama")[0] if which == "hf" else default_model_path()
    code = ("import sys; from shardserve.loader.model_path import resolve_checkpoint; "
            "from shardserve.loader.tokenizer import load_tokenizer; "
            f"tok = load_tokenizer(resolve_checkpoint({path!r})); "
            "print(type(tok).__name__, len(tok), 'torch' in sys.modules)")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    first, second = (r.stdout.split() for r in runs)
    assert second[:2] == first[:2] and second[2] == "False"
