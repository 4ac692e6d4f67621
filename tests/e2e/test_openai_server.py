"""The server through the official openai client: answers equal transformers', streams add up,
usage is exact."""

from __future__ import annotations

import asyncio
import re
from typing import Literal

import httpx
import openai
import pytest
import torch
from pydantic import BaseModel, Field
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
    from shardserve import __version__

    assert httpx.get(tiny_server.url + "/version").json() == {"version": __version__}
    for call in (httpx.get, httpx.post):  # a health probe's other name
        assert call(tiny_server.url + "/ping").json() == {"status": "ok"}
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


# ----------------------------------------------------------------------------- every field honoured or refused

TOOL_CONVERSATION = [
    {"role": "user", "content": "What is the weather like in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "It is sunny and warm."},
]


def low_token(model, tok, ids: list[int]) -> tuple[int, torch.Tensor]:
    """The least likely next token after `ids` whose text is plain and its own (so a top_logprobs
    dict keyed by text cannot confuse it with another token), and the raw logprobs there."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
    texts = [tok.decode([t]) for t in range(lp.shape[0])]
    for t in lp.argsort().tolist():
        if t not in tok.all_special_ids and texts[t].isascii() and texts[t].strip() and texts.count(texts[t]) == 1:
            return t, lp
    raise AssertionError("no plain token")


def chat_ids(tok, messages: list[dict]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


def test_content_parts_and_tool_conversations(client, tiny_server, tok):
    plain = [{"role": "user", "content": "Hello, how are you?\nWhat is the weather like?"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello, how are you?"},
                                          {"type": "text", "text": "What is the weather like?"}]}]
    a, b = (client.chat.completions.create(model=None, messages=m, max_tokens=6, temperature=0) for m in (plain, parts))
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == len(chat_ids(tok, plain))
    # An assistant's tool call (content null) and the tool's answer reach the template as it
    # expects them: the arguments an object, the tool message with its tool_call_id.
    rendered = httpx.post(tiny_server.url + "/tokenize", json={"messages": TOOL_CONVERSATION}).json()["tokens"]
    text = tok.decode(rendered)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\n[call_1] It is sunny and warm.<|im_end|>" in text
    r = client.chat.completions.create(model=None, messages=TOOL_CONVERSATION, max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens == len(rendered) and r.choices[0].finish_reason == "length"


def test_image_parts_are_refused(client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=None, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    err = e.value.body
    assert err["param"] == "messages.0.content" and "does not support images" in err["message"]


def test_echo_with_max_tokens_0_scores_the_prompt(client, tiny_server, tok):
    ids = tok.encode(PROMPT)
    with torch.no_grad():
        full = torch.log_softmax(tiny_server.model(torch.tensor([ids])).logits[0].float(), -1)
    want = full[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == len(ids) and c.logprobs.token_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(c.logprobs.token_logprobs[1:]), want, atol=1e-4, rtol=1e-4)
    chunks = list(client.completions.create(model=None, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                            stream=True, stream_options={"include_usage": True}))
    mine = [ch.choices[0] for ch in chunks if ch.choices]
    assert [m.text for m in mine] == [PROMPT, ""] and mine[-1].finish_reason == "length"
    assert mine[0].logprobs.token_logprobs == c.logprobs.token_logprobs and mine[-1].logprobs.tokens == []
    assert chunks[-1].usage.completion_tokens == 0 and chunks[-1].usage.prompt_tokens == len(ids)


def test_logit_bias_forces_and_bans_a_token(client, tiny_server, tok):
    ids = tok.encode(PROMPT)
    low, lp = low_token(tiny_server.model, tok, ids)
    forced = client.completions.create(model=None, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={str(low): 100})
    assert forced.choices[0].text == tok.decode([low] * 4)
    greedy = hf_greedy(tiny_server.model, ids, 4)
    banned = client.completions.create(model=None, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={str(greedy[0]): -100})
    want = []  # greedy with that token's logit lowered by 100 at every step
    for _ in range(4):
        with torch.no_grad():
            logits = tiny_server.model(torch.tensor([ids + want])).logits[0, -1]
        logits[greedy[0]] -= 100
        want.append(int(logits.argmax()))
    assert greedy[0] not in want and banned.choices[0].text == tok.decode(want) != tok.decode(greedy)
    messages = [{"role": "user", "content": "Hello, how are you?"}]
    chat_low, _ = low_token(tiny_server.model, tok, chat_ids(tok, messages))
    r = client.chat.completions.create(model=None, messages=messages, max_tokens=3, temperature=0,
                                       logit_bias={str(chat_low): 100})
    assert r.choices[0].message.content == tok.decode([chat_low] * 3)


def test_top_logprobs_include_the_sampled_token(client, tiny_server, tok):
    ids = tok.encode(PROMPT)
    low, lp = low_token(tiny_server.model, tok, ids)
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=3, temperature=1, seed=7, logprobs=2,
                                  logit_bias={str(low): 100})
    lps = r.choices[0].logprobs
    assert lps.tokens == [tok.decode([low])] * 3
    assert all(t in top and top[t] == x for t, x, top in zip(lps.tokens, lps.token_logprobs, lps.top_logprobs))
    # the top 2, likeliest first (keyed by text: two partial characters share one key), then the
    # sampled token with the model's own logprob, not the biased one
    first = list(lps.top_logprobs[0].items())
    assert [k for k, _ in first] == list(dict.fromkeys(tok.decode([t]) for t in lp.topk(2).indices.tolist())) + \
        [lps.tokens[0]]
    assert first[-1][1] == pytest.approx(float(lp[low]), abs=1e-4)
    zero = client.completions.create(model=None, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0)
    z = zero.choices[0].logprobs  # logprobs 0: the sampled token's logprob and no other
    assert z.top_logprobs == [{t: x} for t, x in zip(z.tokens, z.token_logprobs)]
    messages = [{"role": "user", "content": "Hello, how are you?"}]
    chat_low, chat_lp = low_token(tiny_server.model, tok, chat_ids(tok, messages))
    c = client.chat.completions.create(model=None, messages=messages, max_tokens=3, temperature=1, seed=7,
                                       logprobs=True, top_logprobs=2, logit_bias={str(chat_low): 100})
    content = c.choices[0].logprobs.content
    assert all(e.token in [t.token for t in e.top_logprobs] for e in content)
    assert [t.token for t in content[0].top_logprobs] == \
        [tok.decode([t]) for t in chat_lp.topk(2).indices.tolist()] + [tok.decode([chat_low])]
    none = client.chat.completions.create(model=None, messages=messages, max_tokens=2, temperature=0, logprobs=True)
    assert [e.top_logprobs for e in none.choices[0].logprobs.content] == [[], []]


def test_streamed_chat_sends_no_empty_chunks_and_echo_hides_special_tokens(client, tok):
    special = tok.convert_tokens_to_ids("<|im_start|>")
    messages = [{"role": "user", "content": "Hello, how are you?"}]
    # Forced special tokens have no text (skip_special_tokens): nothing to send until the end.
    chunks = [c.choices[0] for c in client.chat.completions.create(
        model=None, messages=messages, max_tokens=3, temperature=0, logprobs=True, stream=True,
        logit_bias={str(special): 100}) if c.choices]
    assert [c.delta.role for c in chunks] == ["assistant", None] and chunks[-1].finish_reason == "length"
    assert [e.token for e in chunks[-1].logprobs.content] == ["<|im_start|>"] * 3
    chunks = [c.choices[0] for c in client.chat.completions.create(
        model=None, messages=messages, max_tokens=8, temperature=0, stream=True) if c.choices]
    assert all(c.delta.content for c in chunks[1:-1]) and chunks[0].delta.role == "assistant"
    prompt = [special, *tok.encode(PROMPT)]
    hidden = client.completions.create(model=None, prompt=prompt, max_tokens=1, temperature=0, echo=True)
    shown = client.completions.create(model=None, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                      extra_body={"skip_special_tokens": False})
    assert hidden.choices[0].text.startswith(PROMPT) and shown.choices[0].text.startswith("<|im_start|>" + PROMPT)


@pytest.mark.parametrize(("endpoint", "extra", "field"), [
    ("completions", {"suffix": "and so on"}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"frobnicate": True}, "frobnicate"),
    ("completions", {"temperature": 2.5}, "temperature"),
    ("completions", {"logit_bias": {"5": 150}}, "logit_bias"),
    ("completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"the": 1}}, "logit_bias"),
    ("chat", {"temperature": 2.5}, "temperature"),
    ("chat", {"metadata": {"team": "x"}}, "metadata"),
    ("chat", {"store": True}, "store"),
    ("chat", {"service_tier": "priority"}, "service_tier"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"echo": True}, "echo"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_every_refused_field_is_named(client, endpoint: str, extra: dict, field: str):
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "completions":
            client.completions.create(model=None, prompt=PROMPT, max_tokens=2, extra_body=extra)
        else:
            client.chat.completions.create(model=None, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           extra_body=extra)
    err = e.value.body
    assert err["param"] == field and field in err["message"], err


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    color: Literal["red", "green", "blue"]
    ok: bool


def test_json_schema_from_the_clients_parse_validates_for_every_seed(client):
    """The openai client's parse(): the strict schema it derives from a pydantic model, enforced token
    by token, so a random model sampling at temperature 1 answers objects that validate, seed after seed."""
    people = []
    for seed in range(6):
        r = client.chat.completions.parse(model=None, messages=[{"role": "user", "content": "Who?"}],
                                          response_format=Person, temperature=1.0, seed=seed, max_tokens=80)
        assert r.choices[0].finish_reason == "stop"
        people.append(r.choices[0].message.parsed)  # parsed and validated by pydantic
    assert len({p.model_dump_json() for p in people}) > 1


def test_json_schema_streamed_with_n_2(client):
    schema = Person.model_json_schema() | {"additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    texts = ["", ""]
    for chunk in client.chat.completions.create(model=None, messages=[{"role": "user", "content": "Who?"}],
                                                response_format=fmt, n=2, temperature=1.0, seed=7, max_tokens=80,
                                                stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] != texts[1]
    for t in texts:
        Person.model_validate_json(t)


@pytest.mark.parametrize(("extra", "pattern"), [
    ({"regex": r"[a-z]{2,5}@(foo|bar)\.com"}, r"[a-z]{2,5}@(foo|bar)\.com"),
    ({"ebnf": 'root ::= "(" [1-9] ("," [1-9]){0,3} ")"'}, r"\([1-9](,[1-9]){0,3}\)"),
    ({"grammar": 'root ::= "yes" | "no"'}, r"yes|no"),
], ids=["regex", "ebnf", "grammar"])
def test_regex_and_grammar_fields(client, extra, pattern):
    for seed in range(4):
        r = client.completions.create(model=None, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=seed,
                                      extra_body=extra)
        assert r.choices[0].finish_reason == "stop" and re.fullmatch(pattern, r.choices[0].text), r.choices[0].text


@pytest.mark.parametrize(("extra", "field"), [
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"regex": "[a-"}, "regex"),
    ({"regex": "a", "grammar": 'root ::= "a"'}, "grammar"),
], ids=["unsupported-type", "no-schema", "bad-schema", "bad-regex", "two-kinds"])
def test_structured_output_refusals_name_the_field(client, extra, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=None, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body=extra)
    err = e.value.body
    assert err["param"].startswith(field) and field in err["message"], err


def test_the_api_process_does_not_load_torch(client, tiny_server):
    """The HTTP process only parses, routes and streams: torch (~200 MB, ~2 s of import on each
    start) is the ranks' business. Asked after a request has been served."""
    client.completions.create(model=None, prompt="hello", max_tokens=2, temperature=0)
    with open(f"/proc/{tiny_server.proc.pid}/maps") as f:
        assert "libtorch" not in f.read()
