"""Anthropic Messages bodies as the chat requests they ask for, and chat answers as content blocks."""

from __future__ import annotations

import pytest

from shardserve.server.anthropic_chat import content_blocks, stop_reason, to_chat
from shardserve.server.anthropic_protocol import MessagesRequest
from shardserve.server.errors import APIError
from shardserve.server.protocol import RefusedField
from shardserve.server.reasoning import Reasoning

TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}


def chat(reasoning: Reasoning = Reasoning("qwen3"), **fields):
    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 16, **fields})
    return to_chat(body, reasoning)


def test_conversation_with_tools():
    req = chat(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
               messages=[{"role": "user", "content": "Weather?"},
                         {"role": "assistant", "content": [
                             {"type": "thinking", "thinking": "Call f.", "signature": "s"},
                             {"type": "text", "text": "Let me check."},
                             {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}}]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text",
                                                                                            "text": "sunny"}]},
                             {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": True},
                             {"type": "text", "text": "And tomorrow?"}]}],
               tools=[TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    msgs = [m.model_dump(exclude_none=True) for m in req.messages]
    assert msgs[0] == {"role": "system", "content": "Be brief.\nBe kind."}
    assert msgs[2] == {"role": "assistant", "content": "Let me check.", "reasoning_content": "Call f.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    assert msgs[3:] == [{"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
                        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
                        {"role": "user", "content": "And tomorrow?"}]
    assert req.tool_choice == "required" and req.parallel_tool_calls is False
    assert req.tools[0].function.parameters == TOOL["input_schema"] and req.add_generation_prompt


def test_prefill_thinking_and_fields():
    req = chat(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello,"}],
               stop_sequences=["\n"], temperature=0.5, top_k=3, thinking={"type": "disabled"},
               tool_choice={"type": "tool", "name": "f"}, tools=[TOOL])
    assert req.continue_final_message and not req.add_generation_prompt  # Anthropic's prefill
    assert req.stop == ["\n"] and req.temperature == 0.5 and req.top_k == 3
    assert req.chat_template_kwargs == {"enable_thinking": False}
    assert req.tool_choice.function.name == "f"
    on = chat(messages=[{"role": "user", "content": "Hi"}], thinking={"type": "enabled", "budget_tokens": 4})
    assert on.chat_template_kwargs == {"enable_thinking": True} and on.thinking_budget == 4
    fmt = chat(messages=[{"role": "user", "content": "Hi"}],
               output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}})
    assert fmt.response_format.json_schema.schema_ == {"type": "object"}


@pytest.mark.parametrize("fields,param", [
    ({"thinking": {"type": "enabled", "budget_tokens": 4}}, "thinking"),  # no reasoning parser
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}]},
     "messages.0.content.0"),
    ({"output_config": {"effort": "low"}}, "output_config.effort"),
])
def test_refused(fields, param):
    fields = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    with pytest.raises(APIError) as e:
        chat(Reasoning(), **fields)
    assert e.value.status == 400 and e.value.param == param


def test_blocks_a_model_cannot_read():
    with pytest.raises(RefusedField) as e:
        MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "document", "source": {}}]}]})
    assert e.value.field == "messages.0.content.0" and "document" in e.value.message


def test_answers_as_blocks():
    message = {"role": "assistant", "content": "", "reasoning_content": "hmm", "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "f", "arguments": '{"x": 2}'}}]}
    assert content_blocks(message, None) == [
        {"type": "thinking", "thinking": "hmm", "signature": ""},
        {"type": "tool_use", "id": "toolu_abc", "name": "f", "input": {"x": 2}}]
    assert content_blocks({"content": "hi", "reasoning_content": "x"}, "omitted")[0]["thinking"] == ""
    assert stop_reason("stop", "END", False) == ("stop_sequence", "END")
    assert stop_reason("stop", 7, False) == ("end_turn", None)  # a stop token is the end of the turn
    assert stop_reason("length", None, False) == ("max_tokens", None)
    assert stop_reason("stop", None, True) == ("tool_use", None)


def test_review_cases():
    """Text before a tool result, a budget without 'enabled', malformed tools and blocks: 400s naming the field,
    never 500s; a call cut off by max_tokens is no tool use."""
    ask = [{"role": "user", "content": "Hi"}]
    with pytest.raises(APIError) as e:
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x"},
                                                    {"type": "tool_result", "tool_use_id": "t"}]}])
    assert e.value.param == "messages.0.content.1"
    with pytest.raises(APIError) as e:
        chat(messages=ask, thinking={"type": "adaptive", "budget_tokens": 4})
    assert e.value.param == "thinking.budget_tokens"
    for bad in ({"tools": 5}, {"tools": [{"type": ["x"]}]}):
        with pytest.raises((RefusedField, ValueError)):  # pydantic's ValidationError is a ValueError
            MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": ask, **bad})
    with pytest.raises(RefusedField) as e:
        MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": ["text"]}]}]})
    assert e.value.field == "messages.0.content.0"
    with pytest.raises(RefusedField) as e:
        MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "text"}]}]})
    assert e.value.field == "messages.0.content.0.text"
    assert stop_reason("length", None, True) == ("max_tokens", None)


def test_prefill_and_disabled_thinking_are_not_thinking():
    from shardserve.server.turns import reasoning_for

    r1 = Reasoning("deepseek_r1")
    prefill = chat(r1, messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The"}])
    assert reasoning_for(r1, prefill).name is None  # the continuation is the message's own text
    opens = Reasoning("qwen3", template_opens=True)
    off = chat(opens, messages=[{"role": "user", "content": "Hi"}], thinking={"type": "disabled"})
    assert not reasoning_for(opens, off).opened and reasoning_for(opens, off).name == "qwen3"
    assert reasoning_for(opens, chat(opens, messages=[{"role": "user", "content": "Hi"}])).opened
