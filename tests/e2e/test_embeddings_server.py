"""/v1/embeddings through the official openai client, on a tiny Llama that carries a sentence-transformers config
(mean pooling, then Normalize) and Matryoshka widths: vectors equal transformers' within 1e-4, as floats or base64,
from text or token ids, truncated where the model allows, beside a chat on the same engine; bad input refused."""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
import threading

import openai
import pytest
import torch
from server_util import Server
from transformers import AutoModel, AutoTokenizer

TEXTS = ["The capital of France is Paris.", "Hello", "What is the weather like? It is sunny and warm."]


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    src, _ = tiny_model("llama")
    path = str(tmp_path_factory.mktemp("embedder"))
    shutil.copytree(src, path, dirs_exist_ok=True)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg | {"matryoshka_dimensions": [16, 32, 64]}, f)
    os.makedirs(os.path.join(path, "1_Pooling"))
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}, f)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}],
                  f)
    log = str(tmp_path_factory.mktemp("logs") / "server.log")
    server = Server("--model", path, "--num-pages", "128", "--page-size", "8", "--served-model-name", "emb",
                    log_path=log)
    yield server, path
    code, left = server.stop()
    assert left == [] and code == 0, server.read_log()[-3000:]


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="none", max_retries=0)


def mean_hidden(path: str, ids: list[int]) -> torch.Tensor:
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0].mean(0)


def test_embeddings_equal_transformers(client, served):
    path = served[1]
    tok = AutoTokenizer.from_pretrained(path)
    r = client.embeddings.create(model="emb", input=TEXTS)
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == "emb"
    ids = [tok.encode(t) for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    for d, one in zip(r.data, ids):
        want = torch.nn.functional.normalize(mean_hidden(path, one), dim=0)
        assert len(d.embedding) == 64 and torch.allclose(torch.tensor(d.embedding), want, atol=1e-4)
    by_ids = client.embeddings.create(model="emb", input=ids[1])
    assert torch.allclose(torch.tensor(by_ids.data[0].embedding), torch.tensor(r.data[1].embedding), atol=1e-6)
    short = client.embeddings.create(model="emb", input=TEXTS[0], dimensions=16)
    want = torch.nn.functional.normalize(mean_hidden(path, ids[0])[:16], dim=0)
    assert torch.allclose(torch.tensor(short.data[0].embedding), want, atol=1e-4)


def test_base64_is_the_same_floats(client):
    floats = client.embeddings.create(model="emb", input="Hello", encoding_format="float").data[0].embedding
    raw = client.with_options().post("/embeddings", body={"model": "emb", "input": "Hello",
                                                          "encoding_format": "base64"}, cast_to=object)
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(floats, abs=1e-7)


def test_beside_a_chat(client):
    """A generation and embeddings at once on the same engine: each as it is alone."""
    alone = client.embeddings.create(model="emb", input=TEXTS).data
    chat = {}
    t = threading.Thread(target=lambda: chat.update(r=client.chat.completions.create(
        model="emb", messages=[{"role": "user", "content": "Hello"}], max_tokens=24, temperature=0)))
    t.start()
    together = client.embeddings.create(model="emb", input=TEXTS).data
    t.join(60)
    assert not t.is_alive() and chat["r"].usage.completion_tokens == 24
    for a, b in zip(alone, together):
        assert torch.allclose(torch.tensor(a.embedding), torch.tensor(b.embedding), atol=1e-5)


@pytest.mark.parametrize("body,status,param", [
    ({"input": "Hi", "dimensions": 20}, 400, "dimensions"),
    ({"input": []}, 400, "input"),
    ({"input": ["Hi", ""]}, 400, "input"),
    ({"input": "Hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "Hi", "pooling": "cls"}, 400, "pooling"),
    ({"input": "Hi", "model": "other"}, 404, "model"),
])
def test_bad_input(client, body, status, param):
    with pytest.raises(openai.APIStatusError) as e:
        client.post("/embeddings", body=body, cast_to=object)
    assert e.value.status_code == status and e.value.body["param"] == param, e.value.body
