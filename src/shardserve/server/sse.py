"""Server-sent events for every streaming API, each in its own framing (OpenAI's `data:` lines ending in
[DONE], Anthropic's and the Responses API's named events)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from shardserve.server.errors import APIError


async def sse(events: AsyncIterator[dict], frame: Callable[[dict], str],
              on_error: Callable[[APIError], str], tail: str = "") -> StreamingResponse:
    """Waits for the first event so that a refused request is still an HTTP error, not a stream.
    `frame` writes one event; an APIError after the stream began becomes `on_error`'s event; `tail`
    closes the stream. A client that disconnects closes `events`, which aborts what still runs."""
    try:
        first = await anext(events)
    except StopAsyncIteration:
        first = None

    async def body():
        try:
            if first is not None:
                yield frame(first)
            async for event in events:
                yield frame(event)
        except APIError as e:
            yield on_error(e)
        finally:
            await events.aclose()
        if tail:
            yield tail

    return StreamingResponse(body(), media_type="text/event-stream")


def named(event: dict) -> str:
    """Anthropic's and the Responses API's framing: the event's type as its name."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def numbered() -> Callable[[dict], str]:
    """The Responses API's framing: named events with a sequence_number counting from 0."""
    count = iter(range(2**62))
    return lambda event: named({**event, "sequence_number": next(count)})


def data(event: dict) -> str:
    """OpenAI chat and completions framing."""
    return f"data: {json.dumps(event)}\n\n"
