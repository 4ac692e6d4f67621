"""The OpenAI-extension fields vLLM and SGLang document (and clients such as guidellm send), on a
live server; strict request types; bodies nested too deep; error messages without class names."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from transformers import AutoTokenizer

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Hi"}]
BOTH = {"include_usage": True, "continuous_usage_stats": True}  # what guidellm 0.8.1 sends


@pytest.fixture(scope="module")
def tok(tiny_server):
    return AutoTokenizer.from_pretrained(tiny_server.model_path)


def post(server, path: str, body: dict | bytes) -> httpx.Response:
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    return httpx.post(server.url + path, timeout=60, **kw)


def complete(server, **body) -> dict:
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(server, **body) -> dict:
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def refused(r: httpx.Response, field: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(field) and field in err["message"], err
    return err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_usage_in_every_chunk(tiny_server, path):
    body = {"prompt": PROMPT} if "chat" not in path else {"messages": CHAT}
    chunks = events(tiny_server, path, {**body, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                        "stream_options": BOTH})
    *running, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert running and all("usage" in c for c in running)
    done = [c["usage"]["completion_tokens"] for c in running]
    assert done == sorted(done) and done[-1] == 6 and done[0] <= 1
    assert {c["usage"]["prompt_tokens"] for c in running} == {last["usage"]["prompt_tokens"]}
    plain = events(tiny_server, path, {**body, "max_tokens": 3, "stream_options": {"include_usage": True}})
    assert not any("usage" in c for c in plain[:-1]) and "usage" in plain[-1]


# ------------------------------------------------------------------------------- strict types

@pytest.mark.parametrize(("path", "extra", "field"), [
    ("/v1/completions", {"temperature": True}, "temperature"),
    ("/v1/completions", {"n": True}, "n"),
    ("/v1/completions", {"seed": True}, "seed"),
    ("/v1/completions", {"ignore_eos": 1}, "ignore_eos"),
    ("/v1/completions", {"echo": 0}, "echo"),
    ("/v1/completions", {"max_tokens": 1.5}, "max_tokens"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 1.5, "logprobs": True}, "top_logprobs"),
    ("/tokenize", {"add_special_tokens": 1}, "add_special_tokens"),
    ("/detokenize", {"tokens": [5, True]}, "tokens"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_boolean_is_no_number_nor_a_number_a_boolean(tiny_server, path, extra, field):
    base = {"/v1/completions": {"prompt": PROMPT}, "/v1/chat/completions": {"messages": CHAT},
            "/tokenize": {"prompt": PROMPT}, "/detokenize": {"tokens": [5]}}[path]
    refused(post(tiny_server, path, {**base, **extra}), field)


def test_an_integer_temperature_is_fine(tiny_server):
    assert complete(tiny_server, temperature=1, seed=1)["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("body", [b"[" * 200_000 + b"]" * 200_000,
                                  b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
                                  b'{"prompt": "x", "logit_bias": ' + b'{"a": ' * 300 + b"1" + b"}" * 301],
                         ids=["array", "in-a-field", "300-objects"])
def test_a_body_nested_too_deep_is_a_400(tiny_server, body):
    r = post(tiny_server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert "body" in r.json()["error"]["message"]
    assert complete(tiny_server)["usage"]["completion_tokens"] == 8  # and the server lives on


def test_errors_name_no_exception_class(tiny_server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    no_tools = "{% for m in messages %}{{ m.content }}{% endfor %}"
    r = post(tiny_server, "/v1/chat/completions", {"messages": CHAT, "tools": tools, "max_tokens": 2,
                                                   "chat_template": no_tools})
    err = refused(r, "tools")
    assert "ToolsIgnored" not in err["message"] and "\n" not in err["message"]
    err = refused(post(tiny_server, "/v1/chat/completions", {"messages": CHAT, "chat_template": "{% if %}"}),
                  "chat_template")
    assert "TemplateSyntaxError" not in err["message"]


# ------------------------------------------------------------------------------- sampling fields

def token_ids(choice: dict) -> list[int]:
    """The choice's tokens, from logprobs named by id (return_tokens_as_token_ids)."""
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def test_min_tokens_and_include_stop_str_in_output(tiny_server, tok):
    ids = token_ids(complete(tiny_server, logprobs=0, return_tokens_as_token_ids=True)["choices"][0])
    stop = tok.decode(ids[1:2])  # the second token's text
    cut = complete(tiny_server, stop=[stop])["choices"][0]
    assert cut["finish_reason"] == "stop" and stop not in cut["text"]
    kept = complete(tiny_server, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == cut["text"] + stop and kept["finish_reason"] == "stop"
    held = complete(tiny_server, stop=[stop], min_tokens=5)
    assert held["usage"]["completion_tokens"] >= 5 and stop in held["choices"][0]["text"]
    no_stop_token = complete(tiny_server, stop_token_ids=[ids[1]], min_tokens=4, logprobs=0,
                             return_tokens_as_token_ids=True)["choices"][0]
    assert ids[1] not in token_ids(no_stop_token)[:4] and len(token_ids(no_stop_token)) >= 4
    refused(post(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "min_tokens": 3}), "min_tokens")


def test_allowed_token_ids_and_token_id_names(tiny_server):
    allowed = [33, 42, 89]
    r = chat(tiny_server, allowed_token_ids=allowed, logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True)
    names = [e["token"] for e in r["choices"][0]["logprobs"]["content"]]
    assert len(names) == 6 and {int(n.removeprefix("token_id:")) for n in names} <= set(allowed)
    c = complete(tiny_server, logprobs=1, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    assert all(re.fullmatch(r"token_id:\d+", t) for t in c["tokens"] + [k for d in c["top_logprobs"] for k in d])
    refused(post(tiny_server, "/v1/completions", {"prompt": PROMPT, "allowed_token_ids": [99999]}),
            "allowed_token_ids")


def test_bad_words(tiny_server, tok):
    ids = token_ids(complete(tiny_server, logprobs=0, return_tokens_as_token_ids=True)["choices"][0])
    word = tok.decode(ids[1:3])  # a two-token word the model would say
    assert tok.encode(word, add_special_tokens=False) == ids[1:3]
    got = token_ids(complete(tiny_server, logprobs=0, return_tokens_as_token_ids=True, bad_words=[word])["choices"][0])
    assert got[:2] == ids[:2] and got[2] != ids[2]  # its first token is fine; what would finish it is not


def test_truncate_prompt_tokens(tiny_server, tok):
    ids = tok.encode(PROMPT)
    cut = complete(tiny_server, truncate_prompt_tokens=3)
    assert cut["usage"]["prompt_tokens"] == 3
    assert cut["choices"][0]["text"] == complete(tiny_server, prompt=ids[-3:])["choices"][0]["text"]
    whole = complete(tiny_server, truncate_prompt_tokens=-1)  # the model's context: all of it here
    assert whole["usage"]["prompt_tokens"] == len(ids)


def test_prompt_logprobs(tiny_server, tok):
    ids = tok.encode(PROMPT)
    c = complete(tiny_server, prompt_logprobs=2)["choices"][0]
    echo = complete(tiny_server, echo=True, logprobs=2, max_tokens=1)["choices"][0]["logprobs"]
    plp = c["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, entry, lp in zip(ids[1:], plp[1:], echo["token_logprobs"][1:]):
        assert entry[str(tid)]["logprob"] == pytest.approx(lp, abs=1e-5)
        assert entry[str(tid)]["rank"] >= 1 and 2 <= len(entry) <= 3
        assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2]
    r = chat(tiny_server, prompt_logprobs=0)
    assert len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"] and r["prompt_logprobs"][0] is None
    first = events(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 1})[0]
    assert len(first["choices"][0]["prompt_logprobs"]) == len(ids)


# ------------------------------------------------------------------------------- chat template

def test_chat_template_fields(tiny_server, tok):
    convo = CHAT + [{"role": "assistant", "content": "Hel"}]
    cont = chat(tiny_server, messages=convo, add_generation_prompt=False, continue_final_message=True)
    text = tok.apply_chat_template(convo, add_generation_prompt=False, continue_final_message=True, tokenize=False)
    assert text.endswith("Hel") and cont["usage"]["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))
    refused(post(tiny_server, "/v1/chat/completions", {"messages": convo, "continue_final_message": True}),
            "continue_final_message")
    own = "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking %} and think{% endif %}"
    plain = chat(tiny_server, chat_template=own)
    thinking = chat(tiny_server, chat_template=own, chat_template_kwargs={"enable_thinking": True})
    assert plain["usage"]["prompt_tokens"] == len(tok.encode("Hi", add_special_tokens=False))
    assert thinking["usage"]["prompt_tokens"] == len(tok.encode("Hi and think", add_special_tokens=False))
    # /tokenize renders with the same fields.
    counted = post(tiny_server, "/tokenize", {"messages": convo, "add_generation_prompt": False,
                                              "continue_final_message": True}).json()
    assert counted["tokens"] == tok.encode(text, add_special_tokens=False)
    own_tokens = post(tiny_server, "/tokenize", {"messages": CHAT, "chat_template": own,
                                                 "chat_template_kwargs": {"enable_thinking": True}}).json()
    assert own_tokens["tokens"] == tok.encode("Hi and think", add_special_tokens=False)
    refused(post(tiny_server, "/tokenize", {"prompt": "Hi", "chat_template": own}), "chat_template")


# ------------------------------------------------------------------------------- ids, priority, guided_*

def test_request_id_and_priority(tiny_server):
    assert complete(tiny_server, request_id="job-7")["id"] == "cmpl-job-7"
    assert complete(tiny_server, request_id="job-7")["id"] == "cmpl-job-7"  # reused: the engine's ids stay unique
    assert chat(tiny_server, request_id="job-8", n=2, temperature=1.0)["id"] == "chatcmpl-job-8"
    assert complete(tiny_server, priority=0)["usage"]["completion_tokens"] == 8
    refused(post(tiny_server, "/v1/completions", {"prompt": PROMPT, "priority": 1}), "priority")


@pytest.mark.parametrize(("extra", "check"), [
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"guided_regex": r"[0-9]{3}"}, lambda t: re.fullmatch(r"[0-9]{3}", t)),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
                      "additionalProperties": False}}, lambda t: isinstance(json.loads(t)["a"], bool)),
    ({"guided_grammar": 'root ::= "ab" | "cd"'}, lambda t: t in ("ab", "cd")),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
], ids=["choice", "regex", "json", "grammar", "structured_outputs"])
def test_guided_aliases(tiny_server, extra, check):
    for seed in range(2):
        c = complete(tiny_server, max_tokens=30, temperature=1.0, seed=seed, **extra)["choices"][0]
        assert c["finish_reason"] == "stop" and check(c["text"]), c["text"]


def test_guided_refusals_name_the_field(tiny_server):
    refused(post(tiny_server, "/v1/completions", {"prompt": PROMPT, "guided_regex": "a", "regex": "b"}),
            "guided_regex")
    refused(post(tiny_server, "/v1/completions", {"prompt": PROMPT, "structured_outputs": {"nope": 1}}),
            "structured_outputs")
