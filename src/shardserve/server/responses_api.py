"""/v1/responses: OpenAI's Responses API on the chat path, with stored responses.

The body becomes a ChatRequest (responses_chat.py), which runs exactly as chat completions do,
after the stored conversation of `previous_response_id` (response_store.py). The answer is a
Response object whose `output` holds reasoning (with --reasoning-parser), message and
function_call items; streamed, it is the event sequence the SDK's stream helper accumulates
(response.created, .in_progress, per item .output_item.added, .content_part.added, text or
argument deltas and their .done, .output_item.done, then .completed or .incomplete), each with a
sequence_number; a failure mid-stream is response.failed.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from shardserve.server.errors import APIError
from shardserve.server.generation import Choice, stream_choices
from shardserve.server.response_store import ResponseStore
from shardserve.server.responses_chat import as_history, new_id, output_items, to_chat
from shardserve.server.responses_events import Items
from shardserve.server.responses_protocol import ResponsesRequest
from shardserve.server.sse import numbered, sse
from shardserve.server.tools import ToolUse
from shardserve.server.turns import chat_turn, fetch_images


class ResponsesHandlers:
    def __init__(self, state, store: ResponseStore):
        self.s, self.store = state, store

    async def create(self, body: ResponsesRequest, prefill: str = ""):
        history = []
        if body.previous_response_id is not None:
            stored = self.store.get(body.previous_response_id)
            if stored is None:
                raise APIError(404, f"previous_response_id {body.previous_response_id!r} names no stored response "
                                    f"(never stored, deleted, or dropped beyond --responses-max-stored)",
                               param="previous_response_id")
            history = stored.history
        chat, new = to_chat(body, history, self.s.images_refused)
        reqs, tools = chat_turn(self.s, chat, prefill)
        await fetch_images(self.s, reqs[0].messages)
        head = self._head(body)
        if body.stream:
            frame = numbered()
            return await sse(self._events(reqs, tools, head, body, history + new), frame, lambda e: frame(
                {"type": "error", "code": str(e.status), "message": e.message, "param": e.param}))
        c, thinking = Choice(), Thinking(tools)
        async for _, out in stream_choices(self.s.client, self.s.metrics, reqs, self.s.request_timeout):
            c.add(out)
            thinking.add(out)
        message, _ = tools.message(c.text)
        items = output_items(message, c.finish_reason != "length")
        response = self._finish(head, items, c, thinking.tokens)
        if body.store:
            self.store.put(response, history + new + as_history(items))
        return response

    def get(self, response_id: str) -> dict:
        return self._stored(response_id).response

    def delete(self, response_id: str) -> dict:
        self._stored(response_id)
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def cancel(self, response_id: str) -> dict:
        self._stored(response_id)
        raise APIError(400, "only a background response can be cancelled, and this server runs none (a stored "
                            "response has finished; a streaming one ends when its client disconnects)",
                       param="response_id")

    def _stored(self, response_id: str):
        stored = self.store.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response {response_id!r}", param="response_id")
        return stored

    def _head(self, body: ResponsesRequest) -> dict:
        """The Response object's fields that echo the request."""
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format \
            else {"type": "text"}
        choice = body.tool_choice if body.tool_choice is None or isinstance(body.tool_choice, str) else \
            body.tool_choice.model_dump()
        return {"id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
                "error": None, "incomplete_details": None, "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "model": body.model or self.s.model_name, "output": [],
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "store": body.store, "temperature": body.temperature, "top_p": body.top_p, "text": {"format": fmt},
                "tool_choice": choice or "auto", "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
                "truncation": "disabled", "usage": None, "metadata": body.metadata or {}, "user": body.user}

    @staticmethod
    def _finish(head: dict, items: list[dict], c: Choice, reasoning_tokens: int) -> dict:
        cut = c.finish_reason == "length"
        return {**head, "status": "incomplete" if cut else "completed", "output": items,
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "usage": {"input_tokens": c.prompt_tokens, "input_tokens_details": {"cached_tokens": c.cached_tokens},
                          "output_tokens": len(c.token_ids),
                          "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                          "total_tokens": c.prompt_tokens + len(c.token_ids)}}

    async def _events(self, reqs, tools: ToolUse, head: dict, body: ResponsesRequest,
                      conversation: list[dict]) -> AsyncIterator[dict]:
        stream, items, c, thinking = tools.stream(), Items(), Choice(), Thinking(tools)
        try:
            async for _, out in stream_choices(self.s.client, self.s.metrics, reqs, self.s.request_timeout):
                if not items.started:
                    items.started = True
                    yield {"type": "response.created", "response": head}
                    yield {"type": "response.in_progress", "response": head}
                c.add(out)
                thinking.add(out)
                for delta in stream.deltas(out.text, out.finished):
                    for event in items.feed(delta):
                        yield event
        except APIError as e:
            if not items.started:
                raise  # refused before anything streamed: an HTTP error
            yield {"type": "response.failed", "response": {
                **head, "status": "failed", "output": items.done,
                "error": {"code": "server_error" if e.status >= 500 else "invalid_prompt", "message": e.message}}}
            return
        for event in items.close(c.finish_reason != "length"):
            yield event
        response = self._finish(head, items.done, c, thinking.tokens)
        if body.store:
            self.store.put(response, conversation + as_history(items.done))
        yield {"type": "response.incomplete" if response["status"] == "incomplete" else "response.completed",
               "response": response}


class Thinking:
    """Counts the output tokens that were thinking (usage.output_tokens_details.reasoning_tokens)."""

    def __init__(self, tools: ToolUse):
        self.stream, self.tokens = tools.reasoning.stream(), 0

    def add(self, out) -> None:
        before = self.stream.state
        self.stream.feed(out.text, out.finished)
        if before in ("start", "reasoning") and self.stream.thought:
            self.tokens += len(out.new_ids)
