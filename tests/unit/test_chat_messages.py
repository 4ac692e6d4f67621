"""Chat messages in OpenAI's shapes become what chat templates read (one helper for the server,
the router and LLM.chat); request bodies honour or refuse every field, never ignore one."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from shardserve.chat_messages import ChatMessageError, normalize_messages
from shardserve.gateway.request_key import KeyMaker
from shardserve.server.protocol import ChatRequest, CompletionRequest, RefusedField

TOOL_CONVERSATION = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}, {"type": "text", "text": "Now."}]},
    {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
]


def test_text_parts_are_joined_and_tool_calls_take_the_templates_shape() -> None:
    before = repr(TOOL_CONVERSATION)
    user, assistant, tool = normalize_messages(TOOL_CONVERSATION)
    assert user == {"role": "user", "content": "Weather in Paris?\nNow."}
    # null keys dropped ('tool_calls' in message must mean there are some), arguments an object
    assert assistant == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert tool == TOOL_CONVERSATION[2]
    assert repr(TOOL_CONVERSATION) == before  # the caller's messages are left as they were
    assert normalize_messages(normalize_messages(TOOL_CONVERSATION)) == normalize_messages(TOOL_CONVERSATION)


@pytest.mark.parametrize(("messages", "param", "words"), [
    ([{"role": "user", "content": [{"type": "text", "text": "hi"},
                                   {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}],
     "messages.0.content", "does not support images"),
    ([{"role": "system", "content": "x"}, {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
     "messages.1.content", "does not support audio"),
    ([{"role": "user", "content": 5}], "messages.0.content", "string or an array"),
    ([{"role": "user"}], "messages.0.content", "is required"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content", "text part"),
    ([{"role": "tool", "content": "sunny"}], "messages.0.tool_call_id", "tool call it answers"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages.0.tool_calls", "only an assistant"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
     "messages.0.tool_calls.0.function.arguments", "not valid JSON"),
    ([{"role": "wizard", "content": "x"}], "messages.0.role", "must be one of"),
    ([], "messages", "non-empty"),
])
def test_bad_messages_name_the_part_at_fault(messages, param: str, words: str) -> None:
    with pytest.raises(ChatMessageError, match=words) as e:
        normalize_messages(messages)
    assert e.value.param == param


def test_router_keys_a_chat_as_the_worker_renders_it() -> None:
    keys = KeyMaker()  # character mode
    parts = [{"type": "text", "text": "hi"}]
    as_parts = asyncio.run(keys.key("chat", {"messages": [{"role": "user", "content": parts}]}))
    as_text = asyncio.run(keys.key("chat", {"messages": [{"role": "user", "content": "hi"}]}))
    assert as_parts.ids == as_text.ids


@pytest.mark.parametrize(("model", "field", "value"), [
    (CompletionRequest, "suffix", "tail"),
    (CompletionRequest, "store", True),
    (CompletionRequest, "metadata", {"k": "v"}),
    (ChatRequest, "service_tier", "flex"),
    (ChatRequest, "modalities", ["text", "audio"]),
    (ChatRequest, "functions", [{"name": "f"}]),
])
def test_known_fields_not_honoured_are_refused_by_name(model, field: str, value) -> None:
    body = {"prompt": "hi"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(RefusedField) as e:
        model.model_validate({**body, field: value})
    assert e.value.field == field and field in e.value.message


def test_values_asking_for_nothing_and_nulls_are_accepted() -> None:
    body = CompletionRequest.model_validate({"prompt": "hi", "suffix": "", "store": False, "metadata": {},
                                             "service_tier": "auto", "max_tokens": None, "n": None, "user": "u"})
    assert body.max_tokens == 16 and body.n == 1
    chat = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "modalities": ["text"],
                                       "presence_penalty": None, "logit_bias": {"5": 10}})
    assert chat.presence_penalty == 0.0 and chat.logit_bias == {"5": 10.0}


@pytest.mark.parametrize(("body", "loc", "kind"), [
    ({"prompt": "hi", "temprature": 0.5}, ("temprature",), "extra_forbidden"),
    ({"prompt": "hi", "stream_options": {"include_usage": True, "usage_every_n": 2}},
     ("stream_options", "usage_every_n"), "extra_forbidden"),
    ({"prompt": "hi", "temperature": 2.5}, ("temperature",), "less_than_equal"),
])
def test_unknown_fields_and_out_of_range_values_fail_validation(body: dict, loc: tuple, kind: str) -> None:
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate(body)
    err = e.value.errors()[0]
    assert err["loc"] == loc and err["type"] == kind
