"""The GGUF header reader (loader/gguf_header.py) against gguf-py's own GGUFReader, its errors,
and the tokenizer converted once per file (loader/gguf_tokenizer.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from shardserve.loader.gguf_header import read_header
from shardserve.loader.gguf_tokenizer import load_gguf_tokenizer

TOKENS = ["<s>", "</s>", "a", "b", "c", "Ġ", "ab", "Ġa"]
TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"


def _same_as_gguf_py(path: str) -> None:
    ours, ref = read_header(path), GGUFReader(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # gguf-py's own bookkeeping
    assert list(ours.fields) == keys
    for k in keys:
        want = ref.fields[k].contents()
        assert ours.fields[k] == want and type(ours.fields[k]) is type(want), k
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.shape.tolist(), a.n_elements, a.n_bytes, a.data_offset) == \
            (b.tensor_type, b.shape.tolist(), b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


def _tokenizer_file(path: Path) -> str:
    """A one-tensor llama GGUF with every metadata value type and a small gpt2 vocabulary."""
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 1, 1, 1, 1, 1, 1])
    w.add_token_merges(["a b", "Ġ a"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template(TEMPLATE)
    for i, (vtype, value) in enumerate([(GGUFValueType.UINT8, 7), (GGUFValueType.INT8, -7), (GGUFValueType.UINT16, 9),
                                        (GGUFValueType.INT16, -9), (GGUFValueType.INT32, -2**31),
                                        (GGUFValueType.UINT64, 2**63), (GGUFValueType.INT64, -2**40),
                                        (GGUFValueType.FLOAT64, 0.1), (GGUFValueType.BOOL, True)]):
        w.add_key_value(f"test.scalar{i}", value, vtype)
    w.add_array("test.floats", [0.5, -1.25, 3.0])
    w.add_array("test.bools", [True, False])
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((8, 64), dtype=np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float16))
    for name, qtype in (("blk.0.ffn_up.weight", T.Q4_1), ("blk.0.ffn_down.weight", T.Q8_0),
                        ("blk.0.ffn_gate.weight", T.BF16)):
        w.add_tensor(name, quantize(rng.standard_normal((4, 64), dtype=np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_header_equals_gguf_py_on_smollm2(smollm2_path):
    _same_as_gguf_py(smollm2_path)


def test_header_equals_gguf_py_on_every_value_and_tensor_type(tmp_path):
    _same_as_gguf_py(_tokenizer_file(tmp_path / "t.gguf"))


def test_bad_files_are_refused_naming_the_file(tmp_path):
    good = Path(_tokenizer_file(tmp_path / "t.gguf")).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good[:200])  # inside the metadata
    with pytest.raises(ValueError, match=r"cut\.gguf: GGUF header ends early"):
        read_header(str(cut))
    short = tmp_path / "short.gguf"
    short.write_bytes(good[:-64])  # the last tensor's bytes missing
    with pytest.raises(ValueError, match=r"short\.gguf: tensor blk\.0\.ffn_gate\.weight runs past the end"):
        read_header(str(short))
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGML" + good[4:])
    with pytest.raises(ValueError, match="other.gguf: not a GGUF file"):
        read_header(str(other))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.gguf: not a GGUF file \(empty\)"):
        read_header(str(empty))
    twice = tmp_path / "twice.gguf"  # the last tensor's name given to the one before it (same length)
    twice.write_bytes(good.replace(b"blk.0.ffn_down.weight", b"blk.0.ffn_gate.weight"))
    with pytest.raises(ValueError, match=r"twice\.gguf: tensor blk\.0\.ffn_gate\.weight appears twice"):
        read_header(str(twice))


def test_tokenizer_is_converted_once_then_read_back_the_same(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("SHARDSERVE_CACHE", str(tmp_path / "cache"))
    path = _tokenizer_file(tmp_path / "t.gguf")
    first = load_gguf_tokenizer(path)
    [entry] = (tmp_path / "cache" / "tokenizers").iterdir()
    real = AutoTokenizer.from_pretrained

    def no_conversion(*args, **kwargs):
        assert "gguf_file" not in kwargs, "converted again despite the cache"
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_conversion)
    again = load_gguf_tokenizer(path)
    for text in ("ab a", " a b c", "<s>ab</s>"):
        assert again.encode(text) == first.encode(text)
    assert (again.bos_token, again.eos_token, again.chat_template) == ("<s>", "</s>", TEMPLATE)
    ids = list(range(len(first)))
    assert again.convert_ids_to_tokens(ids) == first.convert_ids_to_tokens(ids)
    assert first.convert_ids_to_tokens(ids)[:len(TOKENS)] == TOKENS
    assert again.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False) == "<s>ab</s>"
    (entry / "tokenizer.json").write_text("{ not json")  # damaged: converted again and replaced
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", real)
    assert load_gguf_tokenizer(path).encode("ab a") == first.encode("ab a")
    assert load_gguf_tokenizer(path).convert_ids_to_tokens(ids) == first.convert_ids_to_tokens(ids)
    assert [p.name for p in (tmp_path / "cache" / "tokenizers").iterdir()] == [entry.name]


def test_an_unwritable_cache_is_said_and_the_tokenizer_still_loads(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SHARDSERVE_CACHE", str(blocker))
    with caplog.at_level(logging.WARNING, logger="shardserve.loader.gguf_tokenizer"):
        tok = load_gguf_tokenizer(_tokenizer_file(tmp_path / "t.gguf"))
    assert tok.encode("ab a") == [6, 7]
    assert "cannot cache the converted tokenizer" in caplog.text
