"""Tool calls through the official openai client: tools reach the chat template, `required` and a named function
are enforced (a random tiny model calls a tool only because the grammar makes it), the call comes back parsed,
streamed as argument deltas, and the tool's answer goes back for a final answer."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from server_util import Server
from tiny_tokenizer import save_tiny_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from shardserve.chat_messages import render_chat

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "celsius": {"type": "boolean"}},
                   "required": ["city", "celsius"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                      "additionalProperties": False}}}
TOOLS = [WEATHER, NOW]
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The tiny random Llama with a 2048-token context: tool definitions make long prompts for a 301-token BPE."""
    path = str(tmp_path_factory.mktemp("tiny_llama_2k"))
    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=None, bos_token_id=None,
                      pad_token_id=None)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    save_tiny_tokenizer(path, 301)
    log = str(tmp_path_factory.mktemp("logs") / "server.log")
    # No --tool-call-parser: the chat template's <tool_call> tags name the hermes format.
    server = Server("--model", path, "--num-pages", "512", "--page-size", "16", log_path=log)
    server.model_path = path
    yield server
    code, left = server.stop()
    assert left == [] and code == 0, server.read_log()[-3000:]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tok(server):
    return AutoTokenizer.from_pretrained(server.model_path)


def prompt_len(tok, messages, tools=None) -> int:
    """Prompt tokens of the chat as the server renders it (chat_messages.render_chat)."""
    return len(tok.encode(render_chat(tok, messages, tools), add_special_tokens=False))


def check_weather_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Rome") and isinstance(args["celsius"], bool) and len(args) == 2
    return args


def test_round_trip(client, tok):
    """Offered tools, a required call, the tool's answer sent back, a final answer."""
    r = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    if call.function.name == "now":
        assert json.loads(call.function.arguments) == {}
    else:
        check_weather_call(call)
    assert r.usage.prompt_tokens == prompt_len(tok, ASK, TOOLS)  # the template rendered the tools
    assert r.usage.prompt_tokens > prompt_len(tok, ASK) + 20
    turn = [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"}]
    final = client.chat.completions.create(model=None, messages=ASK + turn, tools=TOOLS, temperature=0,
                                           max_tokens=6)
    assert final.choices[0].finish_reason == "length" and final.choices[0].message.tool_calls is None
    assert isinstance(final.choices[0].message.content, str)
    # The template saw the call (arguments as an object) and the tool's answer.
    as_template = [{**turn[0], "tool_calls": [{**call.model_dump(), "function": {
        "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]}, turn[1]]
    assert final.usage.prompt_tokens == prompt_len(tok, ASK + as_template, TOOLS)


def test_named_function_and_streaming_agree(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, tool_choice=named, temperature=0,
                                       max_tokens=200)
    (call,) = r.choices[0].message.tool_calls
    args = check_weather_call(call)
    assert r.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, tool_choice=named,
                                                 temperature=0, max_tokens=200, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    head = calls[0]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert all(tc.index == 0 and tc.id is None and tc.function.name is None for tc in calls[1:])
    assert len(calls) > 2  # the arguments come in pieces as they are generated
    streamed = "".join(tc.function.arguments for tc in calls)
    assert streamed == call.function.arguments and json.loads(streamed) == args
    assert not "".join(d.content or "" for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_required_is_enforced_at_temperature_1(client):
    """Every sample of every seed is one well-formed call of an offered tool. (One: the tiny tokenizer has no EOS,
    so only a grammar that cannot go on ends the output; parallel calls could run on to max_tokens.)"""
    seen = set()
    for seed in range(3):
        r = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=1, seed=seed, n=4, max_tokens=200)
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
            (call,) = choice.message.tool_calls
            seen.add(call.function.name)
            if call.function.name == "get_weather":
                check_weather_call(call)
            else:
                assert call.function.name == "now" and json.loads(call.function.arguments) == {}
    assert seen


def test_the_format_comes_from_the_chat_template(server):
    assert "the chat template names the hermes format, so --tool-call-parser hermes is used" in server.read_log()


def test_auto_and_none(client, tok, server):
    """auto: the model may answer in text (a random model does); none: the template gets no tools."""
    r = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, temperature=0, max_tokens=8)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens == prompt_len(tok, ASK, TOOLS)
    r = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0,
                                       max_tokens=8)
    assert r.usage.prompt_tokens == prompt_len(tok, ASK)
    counted = httpx.post(server.url + "/tokenize", json={"messages": ASK, "tools": TOOLS}).json()
    assert counted["count"] == prompt_len(tok, ASK, TOOLS)
    chunks = list(client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, temperature=0, max_tokens=8,
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, temperature=0, max_tokens=8)
    assert text == plain.choices[0].message.content


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": [NOW, NOW]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
])
def test_refused(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=None, messages=ASK, max_tokens=4, **extra)
    assert e.value.status_code == 400 and param in str(e.value), str(e.value)
