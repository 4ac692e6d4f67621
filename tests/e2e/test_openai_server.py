"""The server through the official openai client: answers equal transformers', streams add up,
usage is exact."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tok(tiny_server):
    return AutoTokenizer.from_pretrained(tiny_server.model_path)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_completion_matches_transformers(client, tiny_server, tok):
    ids = tok.encode(PROMPT)
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == tok.decode(hf_greedy(tiny_server.model, ids, 12), skip_special_tokens=True)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 12, len(ids) + 12)


def test_token_prompts_and_batches(client, tiny_server, tok):
    batch = [[5, 6, 7], [8, 9, 10, 11, 12]]
    r = client.completions.create(prompt=batch, max_tokens=6, temperature=0, model=None)
    assert [c.index for c in r.choices] == [0, 1]
    for c, ids in zip(r.choices, batch):
        assert c.text == tok.decode(hf_greedy(tiny_server.model, ids, 6), skip_special_tokens=True)
    assert r.usage.prompt_tokens == 8 and r.usage.completion_tokens == 12


def test_n_stop_logprobs_echo(client, tiny_server, tok):
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=3)
    assert len(r.choices) == 3 and r.usage.completion_tokens == 24
    again = client.completions.create(model=None, prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=3)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    full = client.completions.create(model=None, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = full[3:6]
    cut = client.completions.create(model=None, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    lp = client.completions.create(model=None, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lps = lp.choices[0].logprobs
    # Token strings key top_logprobs (OpenAI's format), so two partial-UTF-8 tokens may share a key.
    assert len(lps.tokens) == 4 and all(1 <= len(t) <= 2 for t in lps.top_logprobs)
    # Greedy: the sampled token is the most likely one.
    assert all(x <= 0 and x == pytest.approx(max(t.values())) for x, t in zip(lps.token_logprobs, lps.top_logprobs))
    echo = client.completions.create(model=None, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPT + lp.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(client, tiny_server, tok):
    ids = tok.encode(PROMPT)
    with torch.no_grad():
        full = torch.log_softmax(tiny_server.model(torch.tensor([ids])).logits[0].float(), -1)
    want = full[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1)
    lps = r.choices[0].logprobs
    assert len(lps.tokens) == len(ids) + 4 and "".join(lps.tokens) == r.choices[0].text
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(lps.token_logprobs[1 : len(ids)]), want, atol=1e-4, rtol=1e-4)
    assert lps.text_offset[len(ids)] == len(PROMPT)
    chunks = list(client.completions.create(model=None, prompt=[ids, ids], max_tokens=2, temperature=0, echo=True,
                                            logprobs=0, stream=True))
    for i in (0, 1):  # each choice's first chunk is its echo, with the prompt's logprobs
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].text == PROMPT and mine[0].logprobs.token_logprobs[0] is None
        torch.testing.assert_close(torch.tensor(mine[0].logprobs.token_logprobs[1:]), want, atol=1e-4, rtol=1e-4)
        # text_offset runs on across chunks (counted in token strings: a partial UTF-8 token's
        # text may be held back from the chunk's text until it completes)
        pos = 0
        for ch in mine:
            assert ch.logprobs.text_offset[:1] in ([], [pos])
            pos += sum(len(t) for t in ch.logprobs.tokens)


def test_chat_and_stream(client, tiny_server, tok):
    messages = [{"role": "user", "content": "Hello, how are you?"}]
    r = client.chat.completions.create(model=None, messages=messages, max_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=2)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    assert r.choices[0].message.content == tok.decode(hf_greedy(tiny_server.model, ids, 10), skip_special_tokens=True)
    assert r.choices[0].finish_reason == "length" and r.usage.prompt_tokens == len(ids)
    assert len(r.choices[0].logprobs.content) == 10
    chunks = list(client.chat.completions.create(model=None, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == len(ids)


def test_stop_string_never_streams_past_the_stop(client):
    full = client.completions.create(model=None, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = full[5:9]
    chunks = list(client.completions.create(model=None, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full[: full.index(stop)]


def test_models_tokenize_detokenize(tiny_server, tok):
    models = httpx.get(tiny_server.url + "/v1/models").json()
    assert models["data"][0]["max_model_len"] == 512
    t = httpx.post(tiny_server.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert t["tokens"] == tok.encode(PROMPT)
    d = httpx.post(tiny_server.url + "/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == PROMPT


def test_64_concurrent_streams(tiny_server, client):
    prompts = [f"Hello {i}, how are you today?" for i in range(64)]
    expected = {p: client.completions.create(model=None, prompt=p, max_tokens=12, temperature=0).choices[0].text
                for p in prompts[:4]}
    aclient = openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)

    async def one(p: str):
        stream = await aclient.completions.create(model=None, prompt=p, max_tokens=12, temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
        text, usage, finish = "", None, None
        async for c in stream:
            if c.choices:
                text += c.choices[0].text
                finish = c.choices[0].finish_reason or finish
            if c.usage:
                usage = c.usage
        return p, text, usage, finish

    async def all_of_them():
        return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(all_of_them())
    assert len(results) == 64
    for p, text, usage, finish in results:
        assert finish == "length" and usage.completion_tokens == 12
        if p in expected:
            assert text == expected[p]
