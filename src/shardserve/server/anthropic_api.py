"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat path.

The body becomes a ChatRequest (anthropic_chat.py), which runs exactly as chat completions do;
the answer comes back as content blocks (thinking, text, tool_use) with Anthropic's stop reasons,
streamed as its events: message_start, ping, content_block_start / _delta / _stop per block,
message_delta (stop reason, output tokens) and message_stop; an error mid-stream is an `error`
event. Errors are in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse

from shardserve.ipc.messages.api import ErrorOut, TokenizeReq
from shardserve.server.anthropic_chat import content_blocks, stop_reason, to_chat, tool_use_id
from shardserve.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from shardserve.server.client import EngineClient
from shardserve.server.errors import APIError
from shardserve.server.generation import Choice, collect, stream_choices
from shardserve.server.request_params import chat_options
from shardserve.server.sse import named, sse
from shardserve.server.tools import ToolUse, chat_tool_use
from shardserve.server.turns import chat_messages, chat_turn, check_model, fetch_images, served_name

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def error_response(e: APIError) -> JSONResponse:
    """Anthropic's errors have no `param`: the field at fault leads the message, as Anthropic's own do."""
    message = e.message if e.param is None or e.param in e.message else f"{e.param}: {e.message}"
    return JSONResponse(anthropic_error(e.status, message), e.status, headers=e.headers)


def usage(c: Choice) -> dict:
    """Anthropic counts input tokens read from the cache apart from the others."""
    return {"input_tokens": c.prompt_tokens - c.cached_tokens, "output_tokens": len(c.token_ids),
            "cache_read_input_tokens": c.cached_tokens, "cache_creation_input_tokens": None}


class MessagesHandlers:
    def __init__(self, state):
        self.s = state

    async def create(self, body: MessagesRequest, prefill: str = ""):
        chat = to_chat(body, self.s.reasoning, self.s.images_refused)
        reqs, tools = chat_turn(self.s, chat, prefill)
        await fetch_images(self.s, reqs[0].messages)
        display = body.thinking.display if body.thinking is not None else None
        meta = {"id": f"msg_{EngineClient.new_rid()}", "type": "message", "role": "assistant",
                "model": served_name(self.s, reqs[0].params.lora_request)}
        if body.stream:
            return await sse(self._events(reqs, meta, tools, display), named,
                             lambda e: named(anthropic_error(e.status, e.message)))
        (c,) = await collect(self.s.client, self.s.metrics, reqs, self.s.request_timeout)
        message, called = tools.message(c.text)
        reason, sequence = stop_reason(c.finish_reason, c.stop_reason, called)
        return {**meta, "content": content_blocks(message, display), "stop_reason": reason,
                "stop_sequence": sequence, "usage": usage(c)}

    async def count_tokens(self, body: CountTokensRequest) -> dict:
        budget = body.thinking.budget_tokens if body.thinking is not None else None
        chat = to_chat(body.model_copy(update={"max_tokens": body.max_tokens or (budget or 0) + 1}), self.s.reasoning,
                       self.s.images_refused)
        check_model(self.s, chat.model)
        tools: ToolUse = chat_tool_use(chat, self.s.tool_format)
        messages = chat_messages(chat.messages, self.s.images_refused)
        await fetch_images(self.s, messages)
        reply = await self.s.client.call(TokenizeReq(
            rid=EngineClient.new_rid(), text=None, messages=messages, tools=tools.tools,
            chat_options=chat_options(chat, messages, self.s.trust_request_chat_template)))
        if isinstance(reply, ErrorOut):
            raise APIError(reply.status, reply.message, reply.param)
        return {"input_tokens": len(reply.token_ids)}

    async def _events(self, reqs, meta: dict, tools: ToolUse, display: str | None) -> AsyncIterator[dict]:
        stream, blocks, c = tools.stream(), _Blocks(display), Choice()
        async for _, out in stream_choices(self.s.client, self.s.metrics, reqs, self.s.request_timeout):
            if not blocks.started:
                blocks.started = True
                yield {"type": "message_start", "message": {
                    **meta, "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": {**usage(Choice(prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens)),
                              "output_tokens": 0}}}
                yield {"type": "ping"}
            c.add(out)
            for delta in stream.deltas(out.text, out.finished):
                for event in blocks.feed(delta):
                    yield event
        for event in blocks.close():
            yield event
        reason, sequence = stop_reason(c.finish_reason, c.stop_reason, stream.called)
        yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
               "usage": {"output_tokens": len(c.token_ids)}}
        yield {"type": "message_stop"}


class _Blocks:
    """Chat deltas (ToolStream) -> content block events, one block open at a time."""

    def __init__(self, display: str | None):
        self.display, self.started = display, False
        self.index, self.open = -1, None  # the open block's index and kind

    def feed(self, delta: dict) -> list[dict]:
        if "reasoning_content" in delta:
            text = "" if self.display == "omitted" else delta["reasoning_content"]
            return self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""}) + (
                [self._delta({"type": "thinking_delta", "thinking": text})] if text else [])
        if "content" in delta:
            return self._ensure("text", {"type": "text", "text": ""}) + [
                self._delta({"type": "text_delta", "text": delta["content"]})]
        (call,) = delta["tool_calls"]
        out = []
        if call.get("id") is not None:  # a new call begins
            out = self.close() + self._start("tool_use", {"type": "tool_use", "id": tool_use_id(call["id"]),
                                                          "name": call["function"]["name"], "input": {}})
        args = call["function"].get("arguments") or ""
        return out + ([self._delta({"type": "input_json_delta", "partial_json": args})] if args else [])

    def _ensure(self, kind: str, block: dict) -> list[dict]:
        return [] if self.open == kind else self.close() + self._start(kind, block)

    def _start(self, kind: str, block: dict) -> list[dict]:
        self.index += 1
        self.open = kind
        return [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        out = [self._delta({"type": "signature_delta", "signature": ""})] if self.open == "thinking" else []
        self.open = None
        return out + [{"type": "content_block_stop", "index": self.index}]
