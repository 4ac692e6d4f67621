"""The OpenAI Responses API through the official openai SDK, on a model that always thinks "Rome?" and answers
"Paris." (scripted_model.py) with --reasoning-parser qwen3: string and item input, reasoning items, a function call
round trip, text.format, previous_response_id over stored responses, retrieve and delete, streaming through the
SDK's own stream helper, max_output_tokens, and bad input."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_util import scripted_server

ASK = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with scripted_server(tmp_path_factory, "--served-model-name", "scripted", "--responses-max-stored", "4") as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def count(server, messages: list[dict], tools: list[dict] | None = None) -> int:
    """Prompt tokens of a chat as the server renders it."""
    return httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": tools}).json()["count"]


def test_string_input(client, server):
    r = client.responses.create(model="scripted", input=ASK, metadata={"run": "1"})
    assert r.status == "completed" and r.output_text == "Paris." and r.id.startswith("resp_")
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Rome?"
    assert r.usage.output_tokens == 9 and r.usage.output_tokens_details.reasoning_tokens == 5  # <think>Rome?</think>
    assert r.usage.input_tokens == count(server, [{"role": "user", "content": ASK}]) and r.metadata == {"run": "1"}
    told = client.responses.create(model="scripted", input=ASK, instructions="Answer in one word.")
    assert told.usage.input_tokens == count(server, [{"role": "system", "content": "Answer in one word."},
                                                     {"role": "user", "content": ASK}])


def test_function_call_round_trip(client, server):
    """'required' is enforced by grammar; the call goes back as items with the tool's output."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": ASK}]}]
    r = client.responses.create(model="scripted", input=items, tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, temperature=0)
    assert [item.type for item in r.output] == ["reasoning", "function_call"]
    call = r.output[1]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    turn = items + [item.model_dump(exclude_none=True) for item in r.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "22 C and sunny"}]
    final = client.responses.create(model="scripted", input=turn, tools=[WEATHER], temperature=0)
    assert final.output_text == "Paris."
    called = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    chat = [{"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "reasoning_content": "Rome?", "tool_calls": [called]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "22 C and sunny"}]
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    assert final.usage.input_tokens == count(server, chat, tools)


def test_text_format_json_schema(client):
    schema = WEATHER["parameters"]
    r = client.responses.create(model="scripted", input=ASK, temperature=0, text={"format": {
        "type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.output[0].content[0].text == "Rome?"  # the thinking is not held to the schema


def test_parse_with_a_pydantic_model(client):
    """The SDK's responses.parse(text_format=Model) sends the model's schema as text.format json_schema."""
    from typing import Literal

    from pydantic import BaseModel

    class City(BaseModel):
        city: Literal["Paris", "Rome"]

    r = client.responses.parse(model="scripted", input=ASK, text_format=City, temperature=0)
    assert r.output_parsed.city in ("Paris", "Rome")


def test_previous_response_id_retrieve_and_delete(client, server):
    first = client.responses.create(model="scripted", input="Hi", instructions="Be brief.")
    second = client.responses.create(model="scripted", input="And Italy?", previous_response_id=first.id)
    # The stored conversation continues; the first response's instructions do not.
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Paris.", "reasoning_content": "Rome?"},
            {"role": "user", "content": "And Italy?"}]
    assert second.usage.input_tokens == count(server, chat) and second.previous_response_id == first.id
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == "Paris." and got.usage == first.usage
    deleted = httpx.delete(f"{server.url}/v1/responses/{first.id}").json()
    assert deleted == {"id": first.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="scripted", input="x", previous_response_id=first.id)
    assert "previous_response_id" in str(e.value)
    unstored = client.responses.create(model="scripted", input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_store_keeps_the_newest(client):
    """--responses-max-stored 4: a fifth response drops the oldest."""
    ids = [client.responses.create(model="scripted", input="Hi", max_output_tokens=2).id for _ in range(5)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


def test_streaming_with_the_sdk_helper(client):
    with client.responses.stream(model="scripted", input=ASK) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == "Paris." and final.status == "completed"
    assert [item.type for item in final.output] == ["reasoning", "message"]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Paris."
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Rome?"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    assert client.responses.retrieve(final.id).output_text == "Paris."  # a streamed response is stored too


def test_streamed_function_call(client):
    kwargs = {"model": "scripted", "input": ASK, "tools": [WEATHER], "tool_choice": "required",
              "parallel_tool_calls": False, "temperature": 0}
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    call = final.output[-1]
    assert call.type == "function_call" and call.arguments == whole.output[-1].arguments
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == call.arguments and "response.function_call_arguments.done" in [e.type for e in events]


def test_max_output_tokens_leaves_it_incomplete(client):
    r = client.responses.create(model="scripted", input=ASK, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"extra_body": {"frequency_penalty": 1}}, "frequency_penalty"),  # a chat field, not a Responses one
])
def test_bad_input(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": "scripted", "input": ASK, **extra})
    assert e.value.status_code == 400 and e.value.param == param, str(e.value)


def test_cancel_and_unknown_ids(client, server):
    r = client.responses.create(model="scripted", input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(r.id)
    assert "background" in str(e.value)
    assert httpx.delete(server.url + "/v1/responses/resp_nothing").status_code == 404


def test_metrics_count_each_endpoint(client, server):
    client.responses.create(model="scripted", input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="scripted", input="Hi", background=True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    text = httpx.get(server.url + "/metrics").text
    ok = [line for line in text.splitlines() if line.startswith("shardserve_http_requests_total{")]
    assert any('endpoint="/v1/responses",status="200"' in line for line in ok), ok
    assert any('endpoint="/v1/responses",status="400"' in line for line in ok), ok
    assert any('endpoint="/v1/responses/{response_id}",status="404"' in line for line in ok), ok
