"""An Anthropic Messages request as the ChatRequest it asks for (the chat template's messages, OpenAI-shaped
tools), and a chat answer as Anthropic content blocks. A 400 names the Anthropic field at fault.

- `system` becomes a system message; a user message's `tool_result` blocks become tool messages (in
  their place among its text), an assistant's `tool_use` blocks its tool_calls and its `thinking`
  its reasoning_content, which is how Hugging Face chat templates read a tool-use conversation.
- A conversation that ends with the assistant's message is continued (Anthropic's prefill), not
  answered anew.
- `tool_choice` any is OpenAI's "required", `tool` a named function; disable_parallel_tool_use is
  parallel_tool_calls false. `output_config.format` is response_format json_schema.
- `thinking`: disabled renders the template with enable_thinking false; enabled or adaptive needs
  --reasoning-parser (true); `budget_tokens` caps the thinking by grammar; display "omitted"
  answers empty thinking blocks.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from shardserve.chat_messages import TEXT_ONLY
from shardserve.server.anthropic_protocol import (
    ImageBlock,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
)
from shardserve.server.errors import APIError
from shardserve.server.protocol import ChatRequest
from shardserve.server.reasoning import Reasoning

CHAT_NAMES = {"stop": "stop_sequences", "response_format": "output_config.format", "max_tokens": "max_tokens",
              "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
              "thinking_budget": "thinking.budget_tokens"}


def to_chat(body: MessagesRequest, reasoning: Reasoning, images_refused: str = TEXT_ONLY) -> ChatRequest:
    """`images_refused`: ServerState's (an image block is a 400 naming it unless empty)."""
    if body.output_config is not None and body.output_config.effort is not None:
        raise APIError(400, "output_config.effort is not supported: no model served here trades effort for "
                            "quality on request", param="output_config.effort")
    messages = ([{"role": "system", "content": _text(body.system)}] if body.system else []) + [
        m for i, msg in enumerate(body.messages) for m in _messages(msg, i, images_refused)]
    prefill = body.messages[-1].role == "assistant" and not any(
        "tool_calls" in m for m in messages[-1:])
    fields = {"model": body.model, "messages": messages, "max_tokens": body.max_tokens, "stream": body.stream,
              "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
              "stop": body.stop_sequences, "chat_template_kwargs": _template_kwargs(body, reasoning),
              "add_generation_prompt": not prefill, "continue_final_message": prefill, **_tools(body),
              "thinking_budget": body.thinking.budget_tokens if body.thinking is not None and
              body.thinking.type == "enabled" else None}
    if body.output_config is not None and body.output_config.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": body.output_config.format.schema_}}
    try:
        return ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        param = CHAT_NAMES.get(where.split(".")[0], where)
        raise APIError(400, f"invalid field {param!r}: {err['msg']}", param=param) from None


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def _messages(msg, i: int, images_refused: str = TEXT_ONLY) -> list[dict]:
    """One Anthropic message -> the chat template's messages (a user's tool results are their own;
    its images, image_url parts among its text)."""
    if isinstance(msg.content, str):
        return [{"role": msg.role, "content": msg.content}]
    where = f"messages.{i}.content"
    if msg.role == "assistant":
        return [_assistant(msg.content, where)]
    out, texts = [], []
    for j, block in enumerate(msg.content):
        if isinstance(block, ToolResultBlock):
            if texts:  # as Anthropic requires: the results answer the calls just before them
                raise APIError(400, "tool_result blocks come first in a user message, before any text",
                               param=f"{where}.{j}")
            answer = _text(block.content)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": f"Error: {answer}" if block.is_error else answer})
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ImageBlock):
            if images_refused:
                raise APIError(400, f"content block type 'image' is not supported: {images_refused}",
                               param=f"{where}.{j}")
            texts.append({"type": "image_url", "image_url": {"url": block.source.as_url()}})
        else:
            raise APIError(400, f"a user message cannot hold a {block.type!r} block", param=f"{where}.{j}")
    if any(isinstance(t, dict) for t in texts):
        out.append({"role": "user", "content": [t if isinstance(t, dict) else {"type": "text", "text": t}
                                                for t in texts]})
    elif texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(blocks: list, where: str) -> dict:
    texts, calls, thinking = [], [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, ToolResultBlock):
            raise APIError(400, "tool results come in the user's message", param=f"{where}.{j}")
        elif isinstance(block, ImageBlock):
            raise APIError(400, "images come in the user's message", param=f"{where}.{j}")
        else:
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input}})
    out = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        out["tool_calls"] = calls
    if thinking:
        out["reasoning_content"] = "\n".join(thinking)
    return out


def _tools(body: MessagesRequest) -> dict:
    out = {}
    if body.tools:
        out["tools"] = [{"type": "function", "function": {
            k: v for k, v in {"name": t.name, "description": t.description, "parameters": t.input_schema,
                              "strict": t.strict}.items() if v is not None}} for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if (choice.type == "tool") != (choice.name is not None):
            raise APIError(400, "tool_choice.name names the tool exactly when tool_choice.type is 'tool'",
                           param="tool_choice.name")
        out["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                              else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
        if choice.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
    return out


def _template_kwargs(body: MessagesRequest, reasoning: Reasoning) -> dict | None:
    kwargs = dict(body.chat_template_kwargs or {})
    thinking = body.thinking
    if thinking is None:
        return kwargs or None
    if thinking.budget_tokens is not None and thinking.type != "enabled":
        raise APIError(400, f"thinking.budget_tokens goes with type 'enabled', not {thinking.type!r}",
                       param="thinking.budget_tokens")
    if thinking.type == "disabled":
        kwargs.setdefault("enable_thinking", False)
        return kwargs
    if reasoning.name is None:
        raise APIError(400, f"thinking {thinking.type!r} needs a reasoning model: start the server with "
                            f"--reasoning-parser", param="thinking")
    if thinking.budget_tokens is not None and thinking.budget_tokens >= body.max_tokens:
        raise APIError(400, "thinking.budget_tokens must be less than max_tokens", param="thinking.budget_tokens")
    kwargs.setdefault("enable_thinking", True)
    return kwargs


def content_blocks(message: dict, display: str | None) -> list[dict]:
    """A chat answer's message (ToolUse.message) as Anthropic content blocks."""
    blocks = []
    if message.get("reasoning_content") is not None:
        thought = "" if display == "omitted" else message["reasoning_content"]
        blocks.append({"type": "thinking", "thinking": thought, "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"] or "{}")})
    return blocks


def tool_use_id(call_id: str) -> str:
    """The parser's call id in Anthropic's style."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish: str | None, stopped_by: str | int | None, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the engine's finish (a call cut off by max_tokens is no call)."""
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stopped_by, str):
        return "stop_sequence", stopped_by
    return "end_turn", None
