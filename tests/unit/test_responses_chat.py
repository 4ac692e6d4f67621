"""Responses API input items as chat messages, output items back, and the bounded response store."""

from __future__ import annotations

import pytest

from shardserve.server.errors import APIError
from shardserve.server.response_store import ResponseStore
from shardserve.server.responses_chat import as_history, input_messages, output_items, to_chat
from shardserve.server.responses_protocol import ResponsesRequest


def test_items_become_a_tool_use_conversation():
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"},
                                                            {"type": "input_text", "text": "In Paris."}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "f!"}]},
             {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}", "id": "fc_1",
              "status": "completed"},
             {"type": "function_call", "call_id": "call_2", "name": "f", "arguments": '{"x": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "hot"}]}]
    assert input_messages(items) == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather?\nIn Paris."},
        {"role": "assistant", "content": None, "reasoning_content": "f!", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "hot"}]
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]


def test_output_items_round_trip_into_history():
    message = {"role": "assistant", "content": "Done.", "reasoning_content": "ok", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "g", "arguments": '{"y": 2}'}}]}
    items = output_items(message, complete=True)
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[1]["content"][0] == {"type": "output_text", "text": "Done.", "annotations": [], "logprobs": []}
    assert as_history(items) == [{"role": "assistant", "content": "Done.", "reasoning_content": "ok", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "g", "arguments": '{"y": 2}'}}]}]
    assert output_items({"content": "cut"}, complete=False)[0]["status"] == "incomplete"


def test_request_fields():
    body = ResponsesRequest.model_validate({
        "model": "m", "input": "Hi", "instructions": "Be kind.", "max_output_tokens": 5, "tool_choice": {
            "type": "function", "name": "f"}, "tools": [{"type": "function", "name": "f", "parameters": {}}],
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}})
    chat, new = to_chat(body, [{"role": "user", "content": "Before"}, {"role": "assistant", "content": "Yes"}])
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user"] and new[0]["content"] == "Hi"
    assert chat.max_tokens == 5 and chat.tool_choice.function.name == "f"
    assert chat.response_format.json_schema.schema_ == {"type": "object"}


@pytest.mark.parametrize("items,param", [
    ([{"type": "item_reference", "id": "x"}], "input.0.type"),
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input.0.content.0"),
    ([{"role": "tool", "content": "x"}], "input.0.role"),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}], "input.0.arguments"),
    ([{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}], "input.0.encrypted_content"),
    ([{"role": "user", "content": "x", "colour": "red"}], "input.0.colour"),
])
def test_bad_items(items, param):
    with pytest.raises(APIError) as e:
        input_messages(items)
    assert e.value.status == 400 and e.value.param == param


def test_store_bounds():
    store = ResponseStore(max_count=3, max_bytes=1700)
    for i in range(4):
        store.put({"id": f"r{i}", "pad": "x" * 100}, [])
    assert len(store) == 3 and store.get("r0") is None and store.dropped == 1
    store.put({"id": "big", "pad": "x" * 900}, [{"content": "y" * 600}])  # room only by dropping two more
    assert store.get("big") is not None and store.bytes <= 1700 and store.get("r2") is None and len(store) == 2
    store.put({"id": "huge", "pad": "x" * 3000}, [])  # larger than the whole store: not stored
    assert store.get("huge") is None and store.get("big") is not None
    assert store.delete("big") and not store.delete("big") and store.get("big") is None


def test_reasoning_items_belong_to_the_next_assistant_turn():
    with pytest.raises(APIError) as e:
        input_messages([{"type": "reasoning", "summary": []}, {"role": "user", "content": "x"}])
    assert e.value.param == "input.0"
    with pytest.raises(APIError):
        input_messages([{"role": "user", "content": "x"}, {"type": "reasoning", "summary": []}])
    body = ResponsesRequest.model_validate({"input": "x", "stream_options": {"include_obfuscation": False}})
    with pytest.raises(APIError) as e:
        to_chat(body, [])
    assert e.value.param == "stream_options"


def test_a_call_cut_off_is_not_carried_on():
    from shardserve.server.responses_chat import call_item, message_item, reasoning_item

    items = [message_item("m", "Let me see."), reasoning_item("r", "hmm"),
             call_item("f", "call_1", "f", '{"x": ', status="incomplete")]
    assert as_history(items) == [{"role": "assistant", "content": "Let me see."}]
