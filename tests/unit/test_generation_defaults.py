"""The model's own sampling defaults: read from generation_config.json or a GGUF, used where a
request leaves a field out, never over a field the request gives."""

from __future__ import annotations

import json
import shutil

import pytest
from gguf import GGUFWriter
from pydantic import ValidationError

from shardserve import LLM, SamplingParams
from shardserve.loader.generation_config import describe, generation_defaults
from shardserve.loader.model_path import Checkpoint
from shardserve.server.openai_api import sampling_params
from shardserve.server.protocol import ChatRequest


def hf_dir(tmp_path, gen: dict | None):
    path = tmp_path / "model"
    path.mkdir()
    if gen is not None:
        (path / "generation_config.json").write_text(json.dumps(gen))
    return Checkpoint(str(path), False)


def test_reads_generation_config_json(tmp_path):
    ckpt = hf_dir(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                             "repetition_penalty": 1.05, "max_new_tokens": 99, "eos_token_id": 2})
    defaults, origin = generation_defaults(ckpt)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}
    assert origin == "from generation_config.json"
    assert describe(defaults, origin) == ("sampling defaults: temperature=0.6 top_p=0.95 top_k=20 min_p=0 "
                                          "repetition_penalty=1.05 (from generation_config.json)")


def test_none_and_directory_sources(tmp_path):
    ckpt = hf_dir(tmp_path, {"temperature": 0.6})
    assert generation_defaults(ckpt, "none") == ({}, "built-in: --generation-config none")
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 0, "min_p": 0.1}))
    defaults, origin = generation_defaults(ckpt, str(other))
    assert defaults == {"top_k": -1, "min_p": 0.1}  # top_k 0 means off, which SamplingParams spells -1
    with pytest.raises(FileNotFoundError, match="no generation_config.json there"):
        generation_defaults(ckpt, str(tmp_path / "missing"))


def test_model_without_defaults_says_so(tmp_path):
    defaults, origin = generation_defaults(hf_dir(tmp_path, None))
    assert defaults == {} and origin == "built-in: the model ships no generation_config.json"
    assert describe(defaults, origin).startswith("sampling defaults: temperature=1 top_p=1 top_k=-1")
    (tmp_path / "model" / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert generation_defaults(Checkpoint(str(tmp_path / "model"), False)) == (
        {}, "built-in: generation_config.json sets none")


def test_reads_gguf_sampling_keys(tmp_path):
    path = str(tmp_path / "m.gguf")
    w = GGUFWriter(path, "llama")
    w.add_float32("general.sampling.temp", 0.25)
    w.add_int32("general.sampling.top_k", 40)
    w.add_float32("general.sampling.top_p", 0.9)
    w.add_int32("general.sampling.mirostat", 0)  # not a request field: ignored
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    defaults, origin = generation_defaults(Checkpoint(path, True))
    assert defaults == {"temperature": 0.25, "top_k": 40, "top_p": pytest.approx(0.9)}
    assert origin == "from m.gguf"


def test_request_fields_win_over_model_defaults():
    defaults = {"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.2}
    body = ChatRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.7)
    p = sampling_params(body, defaults, 8, None)
    assert (p.temperature, p.top_k, p.repetition_penalty, p.top_p) == (0.7, 5, 1.2, 1.0)
    bare = sampling_params(ChatRequest(messages=[{"role": "user", "content": "hi"}]), {}, 8, None)
    assert (bare.temperature, bare.top_k, bare.top_p) == (1.0, -1, 1.0)  # OpenAI's defaults
    with pytest.raises(ValidationError, match="temperature"):  # the server answers it with a 400 naming it
        ChatRequest(messages=[{"role": "user", "content": "hi"}], temperature=-1)


def test_offline_generate_uses_the_models_defaults(tiny_model, tmp_path):
    src, _ = tiny_model("llama")
    path = tmp_path / "greedy-by-default"
    shutil.copytree(src, path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    prompts = [[5, 6, 7], [9, 10]]
    with LLM(str(path), num_pages=64) as llm:
        assert llm.get_default_sampling_params().temperature == 0.0
        by_default = [o.outputs[0].token_ids for o in llm.generate(prompts, use_tqdm=False)]
        greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0), use_tqdm=False)]
        assert by_default == greedy
    with LLM(str(path), num_pages=64, generation_config="none") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_eos_ids_join_config_generation_config_and_tokenizer(tmp_path):
    from types import SimpleNamespace

    from shardserve.config import eos_token_ids
    from shardserve.loader.generation_config import eos_ids

    assert [eos_token_ids(v) for v in (None, 7, [7, 9])] == [(), (7,), (7, 9)]
    cfg, tok = SimpleNamespace(eos_token_ids=(2,)), SimpleNamespace(eos_token_id=5)
    assert eos_ids(hf_dir(tmp_path, {"eos_token_id": [9, 2]}), cfg, tok) == (2, 5, 9)
    assert eos_ids(Checkpoint(str(tmp_path / "model"), True), cfg) == (2,)  # a GGUF: config ids only
    assert eos_ids(Checkpoint(str(tmp_path / "none"), False), cfg, SimpleNamespace(eos_token_id=None)) == (2,)
