"""Chat messages as OpenAI clients send them -> the dicts chat templates read.

Every place that renders a chat uses `normalize_messages` and `render_chat`: the server (chat
completions and /tokenize), the standalone router's routing key and the offline `LLM.chat`, so
one conversation (with its tools) renders to the same tokens everywhere.

- `content` is a string, an array of parts, or null (an assistant message that only calls
  tools: rendered as ""). Text parts (and an assistant's refusal parts) are joined with "\\n", as
  vLLM does for text-only models. For a model that reads images (`images_refused` empty), a
  message with an image part keeps its parts as a list, each image as `{"type": "image", "url"}`,
  which templates render as the model's image marker (tokenizer/image_prompt.py expands it); an
  audio, video or file part is refused, and so is an image elsewhere, saying why.
- An assistant's `tool_calls` keep OpenAI's shape (`{"id", "type": "function", "function":
  {"name", "arguments"}}`) with `arguments` parsed from its JSON string into an object, which is
  what Hugging Face tool-use templates expect (they `tojson` it), as vLLM does.
- A `tool` message must name the `tool_call_id` it answers (and may carry `name`).
- Keys whose value is null are dropped (a template testing `'tool_calls' in message` must not
  find a null one); any other key is passed on for the template to read or not.
"""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "user", "assistant", "tool", "developer")
TEXT_PARTS = {"text": "text", "refusal": "refusal"}  # part type -> the key holding its text
MEDIA_PARTS = {"image_url": "images", "input_image": "images", "image": "images", "input_audio": "audio",
               "audio_url": "audio", "video_url": "video", "file": "files", "input_file": "files"}


class ToolsIgnored(ValueError):
    """Tools offered to a model whose chat template has no place for them (a 400 naming `tools`)."""


def render_chat(tok, messages: list[dict], tools: list[dict] | None = None, options: dict | None = None) -> str:
    """The prompt text of normalized `messages` (and tool definitions, as the model's own template
    renders them), ready for the model's answer. Tools the template ignores are refused, never
    silently dropped. `options` (the API's chat template fields): `chat_template` (Jinja text in
    place of the model's), `add_generation_prompt` (default true), `continue_final_message`
    (default false) and `chat_template_kwargs` (variables the template reads)."""
    opts = dict(options or {})
    kwargs = {"add_generation_prompt": opts.pop("add_generation_prompt", True),
              "continue_final_message": opts.pop("continue_final_message", False),
              **(opts.pop("chat_template_kwargs", None) or {})}
    template = opts.pop("chat_template", None)
    if opts:
        raise ValueError(f"unknown chat template option {sorted(opts)[0]!r}")
    if template is not None:
        kwargs["chat_template"] = template
    elif not getattr(tok, "chat_template", None):
        raise ValueError("this model has no chat template")
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    if tools and text == tok.apply_chat_template(messages, tokenize=False, **kwargs):
        raise ToolsIgnored("this model's chat template does not render tool definitions, so the model "
                           "cannot be offered tools")
    return text


def template_facts(tok) -> dict:
    """What the server reads about the model's chat template at start (the tokenizer worker reports
    it): the template's text, from which it tells the tool-call format, and whether the template
    shows tool definitions at all."""
    template = getattr(tok, "chat_template", None) if tok is not None else None
    if isinstance(template, dict):  # named templates (default, tool_use, ...): each may name the tool format
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    if not template:
        return {"chat_template": "", "renders_tools": False, "prompt_end": ""}
    probe = [{"role": "user", "content": "hi"}]
    tool = [{"type": "function", "function": {"name": "shardserve_probe", "description": "probe",
                                              "parameters": {"type": "object", "properties": {}}}}]
    try:
        renders = "shardserve_probe" in render_chat(tok, probe, tool)
    except Exception:  # a template that fails on tools does not render them
        renders = False
    try:  # how a prompt ends where the model's answer begins (a thinking template opens <think> there)
        prompt_end = render_chat(tok, probe)[-64:]
    except Exception:  # a template that cannot render a plain chat fails each request, saying why
        prompt_end = ""
    return {"chat_template": template, "renders_tools": renders, "prompt_end": prompt_end}


class ChatMessageError(ValueError):
    """A message the chat template cannot be given; `param` names it (e.g. messages.1.content)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def check_template_options(messages: list[dict], options: dict) -> None:
    """How the prompt ends: a new assistant message or the last one continued, never both, and
    only an assistant's message continued (the server's and LLM.chat's one rule)."""
    if options.get("continue_final_message") and options.get("add_generation_prompt", True):
        raise ChatMessageError("continue_final_message", "continue_final_message and add_generation_prompt "
                               "cannot both be true: set add_generation_prompt to false to continue the last message")
    if options.get("continue_final_message") and (not messages or messages[-1]["role"] != "assistant"):
        raise ChatMessageError("continue_final_message", "continue_final_message continues the last message, "
                               "which must be the assistant's")


TEXT_ONLY = "this model reads text only"


def normalize_messages(messages: Any, images_refused: str = TEXT_ONLY) -> list[dict]:
    """The conversation as chat templates read it (a new list; the input is left as it was).
    `images_refused`: why an image part is refused, empty where the model reads them."""
    if not isinstance(messages, list) or not messages:
        raise ChatMessageError("messages", "must be a non-empty array of messages")
    return [_message(m, f"messages.{i}", images_refused) for i, m in enumerate(messages)]


def image_parts(messages: list[dict]) -> list[dict]:
    """The image parts of normalized messages, in the order a template renders them."""
    return [p for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]


def image_urls(messages: list[dict]) -> list[str]:
    return [p["url"] for p in image_parts(messages)]


def _message(m: Any, where: str, images_refused: str) -> dict:
    if not isinstance(m, dict):
        raise ChatMessageError(where, "must be an object with a role and content")
    role = m.get("role")
    if role not in ROLES:
        raise ChatMessageError(f"{where}.role", f"must be one of {', '.join(ROLES)} (got {role!r})")
    out = {k: v for k, v in m.items() if v is not None}
    out["content"] = _content(m.get("content"), role, f"{where}.content", images_refused)
    for key in ("name", "tool_call_id"):
        if key in out and not isinstance(out[key], str):
            raise ChatMessageError(f"{where}.{key}", "must be a string")
    if "tool_calls" in out:
        calls = out["tool_calls"]
        if role != "assistant":
            raise ChatMessageError(f"{where}.tool_calls", "only an assistant message carries tool calls")
        if not isinstance(calls, list):
            raise ChatMessageError(f"{where}.tool_calls", "must be an array of tool calls")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls.{j}") for j, c in enumerate(calls)]
    if role == "tool" and "tool_call_id" not in out:
        raise ChatMessageError(f"{where}.tool_call_id", "a tool message must name the tool call it answers")
    return out


def _content(content: Any, role: str, where: str, images_refused: str) -> str | list[dict]:
    if content is None:
        if role == "assistant":  # OpenAI's shape for a message that only calls tools
            return ""
        raise ChatMessageError(where, "is required: a string or an array of text parts")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatMessageError(where, "must be a string or an array of text parts")
    texts, parts = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url" and not images_refused:
            parts.append({"type": "image", "url": _image_url(part, f"{where}.{j}.image_url")})
            continue
        if kind in MEDIA_PARTS:
            why = f"this model does not support {MEDIA_PARTS[kind]}, only text parts"
            if kind == "image_url" and images_refused != TEXT_ONLY:
                why = images_refused
            elif not images_refused:
                why = f"this model does not support {MEDIA_PARTS[kind]}, only text and image_url parts"
            raise ChatMessageError(where, f"part {j} is {kind!r}: {why}")
        key = TEXT_PARTS.get(kind)
        if key is None or not isinstance(part.get(key), str):
            raise ChatMessageError(where, f"part {j} must be a text part ({{\"type\": \"text\", \"text\": ...}})")
        texts.append(part[key])
        parts.append({"type": "text", "text": part[key]})
    return parts if len(parts) > len(texts) else "\n".join(texts)


def _image_url(part: dict, where: str) -> str:
    """OpenAI's `{"type": "image_url", "image_url": {"url": ...}}` (or the URL as a string)."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise ChatMessageError(where, "must be an object with the image's url (a data: or http(s) URL)")
    if isinstance(spec, dict) and (extra := sorted(set(spec) - {"url", "detail"})):
        raise ChatMessageError(f"{where}.{extra[0]}", "is not a field of image_url")
    if isinstance(spec, dict) and spec.get("detail", "auto") != "auto":
        raise ChatMessageError(f"{where}.detail", "only 'auto': the model sees every image at its own one size")
    return url


def _tool_call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ChatMessageError(f"{where}.function", "must be an object with the function's name and arguments")
    if call.get("type", "function") != "function":
        raise ChatMessageError(f"{where}.type", "must be 'function'")
    args = fn.get("arguments")
    if args is None or args == "":
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ChatMessageError(f"{where}.function.arguments", f"is not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise ChatMessageError(f"{where}.function.arguments", "must be a JSON object")
    out = {k: v for k, v in call.items() if v is not None}
    out["type"] = "function"
    out["function"] = {**{k: v for k, v in fn.items() if v is not None}, "arguments": args}
    return out
