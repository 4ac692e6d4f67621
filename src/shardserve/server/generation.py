"""Run one HTTP request's sub-requests (prompts x n) and merge their outputs.

`stream_choices` yields (choice index, TextOut) as they arrive; on any exit before the end
(an error, or the client disconnecting, which cancels the generator) it aborts what is still
running, so the scheduler frees those pages on its next step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from shardserve.ipc.messages.api import ErrorOut, GenerateReq, TextOut
from shardserve.server.client import EngineClient, Rewind
from shardserve.server.errors import APIError
from shardserve.server.metrics import Metrics


@dataclass(frozen=True)
class Timeouts:
    """How long a request may wait for the engine's next output (`silence`: a stalled engine), and
    how long it may run in all (`total`, --request-timeout; None: no limit)."""

    silence: float = 600.0
    total: float | None = None


@dataclass
class Choice:
    """What one choice accumulated (for non-streaming answers and usage)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    embedding: list[float] | None = None  # an embedding request's pooled hidden states

    def add(self, out: TextOut) -> None:
        self.text += out.text
        self.token_ids.extend(out.new_ids)
        self.logprobs.extend(out.logprobs or [])
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
            self.embedding = out.embedding


async def stream_choices(client: EngineClient, metrics: Metrics, reqs: list[GenerateReq], timeout: Timeouts,
                         replayable: bool = False) -> AsyncIterator[tuple[int, TextOut | Rewind]]:
    """`replayable`: the caller sends nothing before the end and takes `Rewind` (forget choice
    i's output so far: its replica died, and it is being generated again on another)."""
    queue: asyncio.Queue = asyncio.Queue()
    pending = {r.rid: i for i, r in enumerate(reqs)}
    start = time.monotonic()
    last: dict[str, float | None] = {}
    try:
        for r in reqs:
            await client.submit(r, queue, replayable)
        while pending:
            left = timeout.total - (time.monotonic() - start) if timeout.total is not None else timeout.silence
            try:
                item = await asyncio.wait_for(queue.get(), min(timeout.silence, max(left, 0.0)))
            except asyncio.TimeoutError:
                if timeout.total is not None and time.monotonic() - start >= timeout.total:
                    # The finally below aborts what still runs: its pages go back.
                    raise APIError(504, f"the request ran longer than --request-timeout {timeout.total:g} s; "
                                        f"its generation was stopped") from None
                raise APIError(500, f"no output from the engine for {timeout.silence:.0f} s") from None
            if isinstance(item, ErrorOut):
                raise APIError(item.status, item.message, item.param)
            if isinstance(item, Rewind):
                if item.rid in pending:  # (a choice that finished before its replica died stays finished)
                    last[item.rid] = None  # the outage is no inter-token latency
                    yield pending[item.rid], item
                continue
            now = time.monotonic()
            if item.new_ids:
                if item.rid in last:
                    if last[item.rid] is not None:
                        metrics.itl.observe((now - last[item.rid]) / len(item.new_ids))
                else:
                    metrics.ttft.observe(now - start)
                    metrics.prompt_tokens.inc(item.prompt_tokens)
                last[item.rid] = now
                metrics.generation_tokens.inc(len(item.new_ids))
            index = pending[item.rid]
            if item.finished:
                del pending[item.rid]
                client.release(item.rid)
            if item.error is not None:  # this request alone failed (engine, grammar, detokenizer)
                raise APIError(500, item.error)
            yield index, item
    finally:
        for rid in pending:
            await client.abort(rid)


async def collect(client: EngineClient, metrics: Metrics, reqs: list[GenerateReq],
                  timeout: Timeouts) -> list[Choice]:
    choices = [Choice() for _ in reqs]
    async for i, out in stream_choices(client, metrics, reqs, timeout, replayable=True):
        if isinstance(out, Rewind):
            choices[i] = Choice()
        else:
            choices[i].add(out)
    return choices


def usage(choices: list[Choice], n: int) -> dict:
    """The prompt counts once per prompt (choices come n at a time), completions per choice."""
    prompt = sum(c.prompt_tokens for c in choices[::n])
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(c.cached_tokens for c in choices[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
