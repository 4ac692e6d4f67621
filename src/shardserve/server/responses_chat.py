"""A Responses API request as the ChatRequest it asks for, and a chat answer as Responses output items.

- `input`: a string (one user message) or items: messages (roles user, system, developer,
  assistant; `input_text`/`output_text`/`refusal` parts), `function_call` items (an assistant's
  tool_calls, joined to the assistant message before them), `function_call_output` items (tool
  messages) and `reasoning` items (the next assistant message's reasoning_content). A 400 names
  the item at fault (`input.3.content.0`).
- `instructions` is a system message first; it is not carried to a response that continues this
  one (previous_response_id), as OpenAI defines it. The conversation that is carried is
  `history`: earlier inputs and outputs as chat messages.
- `text.format` is response_format; `tools` are function tools in chat's shape.
"""

from __future__ import annotations

import uuid

from pydantic import ValidationError

from shardserve.chat_messages import TEXT_ONLY
from shardserve.server.errors import APIError
from shardserve.server.protocol import ChatRequest
from shardserve.server.responses_protocol import ResponsesRequest

ITEM_KEYS = {"message": {"type", "role", "content", "id", "status", "phase"},
             "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
             "function_call_output": {"type", "call_id", "output", "id", "status"},
             "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"}}
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal", "reasoning_text": "text",
              "summary_text": "text"}
CHAT_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format", "stop": "stop"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def to_chat(body: ResponsesRequest, history: list[dict], images_refused: str = TEXT_ONLY
            ) -> tuple[ChatRequest, list[dict]]:
    """(the chat request, this request's input as chat messages); `images_refused`: ServerState's."""
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    new = input_messages(body.input, images_refused)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields = {"model": body.model, "messages": system + history + new, "max_tokens": body.max_output_tokens,
              "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
              "parallel_tool_calls": body.parallel_tool_calls, "chat_template_kwargs": body.chat_template_kwargs,
              "response_format": _format(body)}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                           for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                        "function": {"name": choice.name}}
    try:
        return ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None}), new
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        param = CHAT_NAMES.get(where.split(".")[0], where)
        raise APIError(400, f"invalid field {param!r}: {err['msg']}", param=param) from None


def _format(body: ResponsesRequest) -> dict | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise APIError(400, "text.format of type 'json_schema' needs a schema", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_}}


def input_messages(items: str | list[dict], images_refused: str = TEXT_ONLY) -> list[dict]:
    """Input items as chat messages; an input_image part becomes an image_url part where the model
    reads images (`images_refused` empty)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    thought = None  # a reasoning item's text, for the assistant message it precedes
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message" if "role" in item else None) if isinstance(item, dict) else None
        kind = kind if isinstance(kind, str) else None
        if kind not in ITEM_KEYS:
            raise APIError(400, f"input item type {kind!r} is not supported: give messages, function_call, "
                                f"function_call_output or reasoning items", param=f"{where}.type")
        extra = sorted(set(item) - ITEM_KEYS[kind])
        if extra:
            raise APIError(400, f"unrecognized field {extra[0]!r} of a {kind} item", param=f"{where}.{extra[0]}")
        if kind == "reasoning":
            thought = _reasoning(item, where)
            continue
        belongs = kind == "function_call" or (kind == "message" and item.get("role") == "assistant")
        if thought is not None and not belongs:
            raise APIError(400, "a reasoning item comes just before the assistant message or function call it "
                                "belongs to", param=f"input.{i - 1}")
        if kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append(_output(item, where) if kind == "function_call_output" else
                       _message(item, where, images_refused))
        if out[-1]["role"] == "assistant" and thought is not None:
            out[-1]["reasoning_content"], thought = thought, None
    if thought is not None:
        raise APIError(400, "a reasoning item comes just before the assistant message or function call it "
                            "belongs to", param=f"input.{len(items) - 1}")
    return out


def _reasoning(item: dict, where: str) -> str:
    if item.get("encrypted_content"):
        raise APIError(400, "encrypted reasoning comes from OpenAI's models", param=f"{where}.encrypted_content")
    return "\n".join(_texts(item.get("content") or item.get("summary") or [], f"{where}.content"))


def _output(item: dict, where: str) -> dict:
    output = item.get("output")
    text = output if isinstance(output, str) else "\n".join(_texts(output, f"{where}.output"))
    return {"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text}


def _message(item: dict, where: str, images_refused: str = TEXT_ONLY) -> dict:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise APIError(400, f"role must be user, system, developer or assistant, got {role!r}", param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    parts = _parts(content, f"{where}.content", images_refused)
    if all(isinstance(p, str) for p in parts):
        return {"role": role, "content": "\n".join(parts)}
    return {"role": role, "content": [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]}


def _parts(parts, where: str, images_refused: str = TEXT_ONLY) -> list[str | dict]:
    """Each part's text, or (where the model reads images) an input_image as a chat image_url part."""
    if not isinstance(parts, list):
        raise APIError(400, "must be a string or an array of text parts", param=where)
    out: list[str | dict] = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and not images_refused:
            out.append(_image(part, f"{where}.{j}"))
            continue
        key = TEXT_PARTS.get(kind)
        if key is None or not isinstance(part.get(key), str):
            why = "give input_text parts"
            if kind in ("input_image", "input_file", "input_audio"):
                why = images_refused if kind == "input_image" else \
                    "this model reads text only" + (" and images" if not images_refused else "")
            raise APIError(400, f"content part type {kind!r} is not supported: {why}", param=f"{where}.{j}")
        out.append(part[key])
    return out


def _image(part: dict, where: str) -> dict:
    """An input_image part (its image_url a data: URL) as a chat image_url part."""
    if extra := sorted(set(part) - {"type", "image_url", "detail", "file_id"}):
        raise APIError(400, f"unrecognized field {extra[0]!r} of an input_image part", param=f"{where}.{extra[0]}")
    if part.get("file_id") is not None:
        raise APIError(400, "files are not stored here: give the image as image_url (a data: URL)",
                       param=f"{where}.file_id")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise APIError(400, "image_url must be the image as a data: or http(s) URL", param=f"{where}.image_url")
    return {"type": "image_url", "image_url": {"url": url, "detail": part.get("detail") or "auto"}}


def _texts(parts, where: str) -> list[str]:
    """A part list that holds text only (a tool's output, a reasoning item)."""
    return _parts(parts, where)  # images refused: TEXT_ONLY


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{key} must be a string", param=f"{where}.{key}")
    return value


def output_items(message: dict, complete: bool) -> list[dict]:
    """A chat answer's message (ToolUse.message) as output items; `complete`: not cut off by
    max_output_tokens."""
    items = []
    if message.get("reasoning_content") is not None:
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"], complete))
    for call in message.get("tool_calls") or []:
        items.append(call_item(new_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def message_item(item_id: str, text: str | None, complete: bool = True, status: str | None = None) -> dict:
    part = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text is not None else []
    return {"type": "message", "id": item_id, "role": "assistant", "content": part,
            "status": status or ("completed" if complete else "incomplete")}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def as_history(items: list[dict]) -> list[dict]:
    """Output items as the chat messages a continuing response is rendered with. A call cut off by
    max_output_tokens (status incomplete: its arguments may not parse) is not carried on, nor the
    thinking before it."""
    kept = [item for item in items if not (item["type"] == "function_call" and item["status"] == "incomplete")]
    while kept and kept[-1]["type"] == "reasoning":
        kept.pop()
    return input_messages([{k: v for k, v in item.items() if k in ITEM_KEYS[item["type"]] and k != "status"}
                           for item in kept]) if kept else []
