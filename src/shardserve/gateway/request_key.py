"""What the standalone router routes an OpenAI request by: its prompt as a list of ints, and the
decode tokens it may ask for.

With the model's tokenizer the ints are token ids, so page digests line up with the workers'
own pages; without one they are the prompt's characters (as sgl-router does): affinity still
works, it just counts characters instead of tokens. The body itself is forwarded unchanged, so
only what routing needs is checked here; the worker validates the rest.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from shardserve.chat_messages import normalize_messages, render_chat
from shardserve.http_common import BodyError, json_object


class BadRequest(Exception):
    """Input the router refuses itself, before any worker sees it (answered with a 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class RouteKey:
    ids: list[int]  # token ids, or code points in character mode
    max_tokens: int | None  # decode tokens asked for in all (x n), None when the body leaves it out


def parse_json_object(raw: bytes) -> dict:
    try:
        return json_object(raw)
    except BodyError as e:
        raise BadRequest(str(e)) from None


def _max_tokens(body: dict) -> int | None:
    def count(v: Any) -> int | None:  # bool is an int to Python, not to JSON
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    n = count(body.get("max_tokens"))
    if n is None:
        n = count(body.get("max_completion_tokens"))
    choices = count(body.get("n")) or 1
    return None if n is None else n * choices


def _is_id(t: Any) -> bool:
    # Within int64: page digests pack ids as 8-byte integers; anything else is the worker's to refuse.
    return isinstance(t, int) and not isinstance(t, bool) and -(2**63) <= t < 2**63


def canonical_chat_text(messages: list) -> str:
    """A stable text of chat messages for character mode (or a tokenizer without a template)."""
    parts = []
    for m in messages:
        if isinstance(m, dict):
            content = m.get("content")
            text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
            parts.append(f"{m.get('role')}\n{text}\n")
        else:
            parts.append(json.dumps(m, sort_keys=True) + "\n")
    return "".join(parts)


class KeyMaker:
    """Turns a parsed body into a `RouteKey`; tokenizes on one background thread, because a
    Hugging Face tokenizer is not safe to call from several threads at once and a long prompt
    would otherwise stall every other request on the event loop."""

    def __init__(self, tokenizer: Any | None = None):
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="router-tokenizer") if tokenizer else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def key(self, kind: str, body: dict) -> RouteKey:
        """`kind` is "completions" or "chat"; raises BadRequest when the routed field is missing."""
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("'messages' must be a non-empty list of messages", param="messages")
            # The tools are part of the prompt the worker renders (unless tool_choice is "none").
            tools = body.get("tools") if body.get("tool_choice") != "none" else None
            ids = await self._run(self._chat_ids, messages, tools if isinstance(tools, list) else None)
        else:
            if "prompt" not in body or body["prompt"] is None:
                raise BadRequest("the request has no 'prompt'", param="prompt")
            ids = await self._run(self._prompt_ids, body["prompt"])
        return RouteKey(ids, _max_tokens(body))

    async def _run(self, fn: Callable[..., list[int]], *args: Any) -> list[int]:
        if self._pool is None:
            return fn(*args)  # characters: no tokenizer to wait for
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return [ord(c) for c in text]
        return list(self.tokenizer.encode(text))

    def _prompt_ids(self, prompt: Any) -> list[int]:
        # A batch routes by its first prompt: the whole body goes to one worker.
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._encode(prompt)
        if isinstance(prompt, list) and all(_is_id(t) for t in prompt):
            return prompt  # token ids are the key as they are, in either mode
        return []  # a shape the worker will refuse; route it anywhere and let the worker answer

    def _chat_ids(self, messages: list, tools: list | None = None) -> list[int]:
        try:  # the shape the workers render (text parts joined, tool calls' arguments parsed)
            messages = normalize_messages(messages)
        except ValueError:
            pass  # the worker will say what is wrong; route by what was sent
        tok = self.tokenizer
        if tok is not None and getattr(tok, "chat_template", None):
            try:
                text = render_chat(tok, messages, tools)
            except Exception:  # malformed messages or tools: the worker will say what is wrong
                text = None
            if isinstance(text, str):
                return self._encode(text)
        return self._encode(canonical_chat_text(messages))
