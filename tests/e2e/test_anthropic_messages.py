"""The Anthropic Messages API through the official `anthropic` SDK, on a model that always thinks "Rome?" and
answers "Paris." (scripted_model.py) behind --api-key and --reasoning-parser qwen3: text and thinking blocks,
stop sequences, max_tokens, streaming through the SDK's own helper, a tool use round trip, count_tokens,
structured output, a thinking budget, and bad input answered in Anthropic's error shape."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from server_util import scripted_server

KEY = "sk-test-messages"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with scripted_server(tmp_path_factory, "--api-key", KEY, "--served-model-name", "scripted") as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def post(server, path: str, body: dict, key: str = KEY) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"x-api-key": key}, timeout=60)


def test_text_and_thinking_blocks(client):
    r = client.messages.create(model="scripted", max_tokens=32, messages=ASK)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == "Rome?" and r.content[1].text == "Paris."
    assert r.stop_reason == "end_turn" and r.stop_sequence is None and r.role == "assistant"
    assert r.id.startswith("msg_") and r.model == "scripted"
    assert r.usage.output_tokens == 9  # 8 tokens and EOS
    counted = client.messages.count_tokens(model="scripted", messages=ASK)
    assert counted.input_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens > 5
    thinking = client.messages.count_tokens(model="scripted", messages=ASK,
                                            thinking={"type": "enabled", "budget_tokens": 1024})
    assert thinking.input_tokens == counted.input_tokens


def test_stop_sequences_and_max_tokens(client):
    r = client.messages.create(model="scripted", max_tokens=32, messages=ASK, stop_sequences=["is"])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "is" and r.content[-1].text == "Par"
    r = client.messages.create(model="scripted", max_tokens=3, messages=ASK)
    assert r.stop_reason == "max_tokens" and [b.type for b in r.content] == ["thinking"]
    assert r.content[0].thinking == "Rome"


def test_streaming_with_the_sdk_helper(client):
    with client.messages.stream(model="scripted", max_tokens=32, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Paris." and final.stop_reason == "end_turn"
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == "Rome?"
    assert final.usage.output_tokens == 9


def test_raw_stream_events(server):
    with httpx.stream("POST", server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                      json={"model": "scripted", "max_tokens": 32, "messages": ASK, "stream": True}) as r:
        events = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert events[-2:] == ["message_delta", "message_stop"]
    assert events.count("content_block_start") == events.count("content_block_stop") == 2


def test_tool_use_round_trip(client):
    """tool_choice any is enforced by grammar (no --tool-call-parser: the template's <tool_call> names hermes);
    the model thinks first, then calls (one: after it the script is lost, and parallel calls could run on to
    max_tokens); the tool's result goes back and the model answers. Greedy (Anthropic's default temperature is
    1, and the grammar leaves the script, where the model's choices are ties)."""
    greedy = {"temperature": 0}  # the SDK no longer takes it as an argument
    r = client.messages.create(model="scripted", max_tokens=80, messages=ASK, tools=[WEATHER],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=greedy)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["thinking", "tool_use"]
    call = r.content[1]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Rome") and call.id.startswith("toolu_")
    with client.messages.stream(model="scripted", max_tokens=80, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                extra_body=greedy) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].input == call.input
    named = client.messages.create(model="scripted", max_tokens=80, messages=ASK, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert named.stop_reason == "tool_use" and named.content[-1].name == "get_weather"
    turn = [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "22 C, sunny"}]}]
    final = client.messages.create(model="scripted", max_tokens=32, messages=ASK + turn, tools=[WEATHER])
    assert final.stop_reason == "end_turn" and final.content[-1].text == "Paris."
    cut = client.messages.create(model="scripted", max_tokens=12, messages=ASK, tools=[WEATHER],
                                 tool_choice={"type": "any"}, extra_body=greedy)
    assert cut.stop_reason == "max_tokens"  # a call cut off is no tool use
    longer = client.messages.count_tokens(model="scripted", messages=ASK + turn, tools=[WEATHER])
    assert longer.input_tokens > client.messages.count_tokens(model="scripted", messages=ASK).input_tokens + 20


def test_structured_output_and_thinking_budget(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    r = client.messages.create(model="scripted", max_tokens=40, messages=ASK,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert r.content[0].thinking == "Rome?" and r.content[1].text in ('{"city": "Paris"}', '{"city": "Rome"}')
    r = client.messages.create(model="scripted", max_tokens=40, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 2})
    assert r.content[0].thinking == "Rome" and r.content[1].text == "Paris."  # "?" was over budget
    r = client.messages.create(model="scripted", max_tokens=40, messages=ASK,
                               thinking={"type": "adaptive", "display": "omitted"})
    assert r.content[0].thinking == "" and r.content[1].text == "Paris."


def test_parse_with_a_pydantic_model(client):
    """The SDK's messages.parse(output_format=Model) sends the model's schema as output_config.format."""
    from typing import Literal

    from pydantic import BaseModel

    class City(BaseModel):
        city: Literal["Paris", "Rome"]

    r = client.messages.parse(model="scripted", max_tokens=40, messages=ASK, output_format=City)
    assert r.parsed_output.city in ("Paris", "Rome") and r.content[0].thinking == "Rome?"


def test_raw_http_sampling_fields(server):
    """Older clients send temperature, top_p and top_k: honoured (top_k 1 is greedy at any temperature)."""
    r = post(server, "/v1/messages", {"model": "scripted", "max_tokens": 32, "messages": ASK, "temperature": 1,
                                      "top_k": 1, "top_p": 0.9, "metadata": {"user_id": "u1"}})
    assert r.status_code == 200 and r.json()["content"][-1] == {"type": "text", "text": "Paris."}


@pytest.mark.parametrize("body,status,param", [
    ({"model": "scripted", "messages": ASK}, 400, "max_tokens"),
    ({"model": "scripted", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     400, "messages.0.content.0"),
    ({"model": "scripted", "max_tokens": 8, "messages": ASK, "top_n": 3}, 400, "top_n"),
    ({"model": "scripted", "max_tokens": 8, "messages": ASK, "tools": [{"type": "web_search_20250305",
                                                                         "name": "web_search"}]}, 400, "tools.0"),
    ({"model": "scripted", "max_tokens": 8, "messages": ASK, "container": "c1"}, 400, "container"),
    ({"model": "scripted", "max_tokens": 8, "messages": ASK, "output_config": {"effort": "high"}}, 400, "effort"),
    ({"model": "scripted", "max_tokens": 8, "messages": ASK, "temperature": 1.5}, 400, "temperature"),
    ({"model": "scripted", "max_tokens": 8, "messages": ASK, "thinking": {"type": "enabled",
                                                                           "budget_tokens": 8}}, 400, "budget"),
    ({"model": "claude-opus-4", "max_tokens": 8, "messages": ASK}, 404, "claude-opus-4"),
])
def test_bad_input_in_anthropic_shape(server, body, status, param):
    r = post(server, "/v1/messages", body)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and param in error["error"]["message"]
    assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_bad_key(server, client):
    r = post(server, "/v1/messages", {"model": "scripted", "max_tokens": 8, "messages": ASK}, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="scripted", max_tokens=8, messages=ASK)
    # A Bearer key works too (the OpenAI routes' header).
    ok = httpx.post(server.url + "/v1/messages/count_tokens", json={"model": "scripted", "messages": ASK},
                    headers={"authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["input_tokens"] > 5
