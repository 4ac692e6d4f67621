"""/v1/completions and /v1/chat/completions: requests in, OpenAI-shaped JSON or SSE out."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from shardserve.core import SamplingParams
from shardserve.ipc.messages import DetokenizeOut, DetokenizeReq, GenerateReq
from shardserve.server.client import EngineClient
from shardserve.server.errors import APIError
from shardserve.server.generation import Choice, collect, stream_choices, usage
from shardserve.server.protocol import ChatRequest, CompletionRequest, error_body

MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_params(body, defaults: dict, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's fields; those it leaves out come from `defaults` (the model's), else
    SamplingParams' own."""
    given = {k: getattr(body, k) for k in MODEL_DEFAULTED if getattr(body, k) is not None}
    try:
        return SamplingParams(
            **{**defaults, **given}, n=1, max_tokens=max_tokens, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, seed=body.seed, stop=body.stop or [],
            stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=body.skip_special_tokens,
        )
    except ValueError as e:
        param = str(e).split(".", 1)[1].split(" ", 1)[0] if str(e).startswith("SamplingParams.") else None
        raise APIError(400, str(e).removeprefix("SamplingParams."), param=param) from None


def fan_out(prompts: list[dict], params: SamplingParams, n: int, **extra) -> list[GenerateReq]:
    """prompts x n sub-requests, choice index = prompt * n + sample; sample i gets seed + i."""
    reqs = []
    for p in prompts:
        for i in range(n):
            one = dataclasses.replace(params, seed=params.sample_seed(i))
            reqs.append(GenerateReq(rid=EngineClient.new_rid(), params=one, **p, **extra))
    return reqs


def completion_prompts(prompt) -> list[dict]:
    if isinstance(prompt, str):
        prompts = [{"text": prompt}]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [{"token_ids": prompt}]
    else:
        prompts = [{"text": p} if isinstance(p, str) else {"token_ids": p} for p in prompt]
    if not prompts or any(not (p.get("text") or p.get("token_ids")) for p in prompts):
        raise APIError(400, "the prompt is empty", param="prompt")
    return prompts


class OpenAIHandlers:
    def __init__(self, state):
        self.s = state

    def _admit(self, body, count: int) -> None:
        s = self.s
        if body.model is not None and body.model != s.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {s.model_name!r}",
                           param="model")
        if not 1 <= body.n <= s.max_n:
            raise APIError(400, f"n must be between 1 and {s.max_n}, got {body.n}", param="n")
        if count // body.n > s.max_prompts:
            raise APIError(400, f"{count // body.n} prompts exceed the limit of {s.max_prompts} per request "
                                f"(--max-prompts)", param="prompt")
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > s.max_stop_strings:
            raise APIError(400, f"{len(stops)} stop strings exceed the limit of {s.max_stop_strings} "
                                f"(--max-stop-strings)", param="stop")
        if any(len(x) > s.max_stop_length for x in stops):
            raise APIError(400, f"a stop string longer than {s.max_stop_length} characters (--max-stop-length)",
                           param="stop")
        if s.client.num_active + count > s.max_queued:
            raise APIError(503, "the server is at its queue limit; retry later", headers={"Retry-After": "1"})

    async def completions(self, body: CompletionRequest):
        prompts = completion_prompts(body.prompt)
        self._admit(body, len(prompts) * body.n)
        # echo + logprobs scores the prompt too, as OpenAI's legacy completions do.
        params = sampling_params(body, self.s.sampling_defaults, body.max_tokens, body.logprobs,
                                 body.logprobs if body.echo else None)
        reqs = fan_out(prompts, params, body.n)
        echo = [await self._prompt_text(p) for p in prompts] if body.echo else None
        meta = {"id": f"cmpl-{EngineClient.new_rid()}", "created": int(time.time()), "model": self.s.model_name}
        if body.stream:
            return await self._sse(self._completion_chunks(reqs, meta, body, echo))
        choices = await collect(self.s.client, self.s.metrics, reqs, self.s.request_timeout)
        out = []
        for i, c in enumerate(choices):
            text = (echo[i // body.n] if echo else "") + c.text
            lps = (c.prompt_logprobs or []) + c.logprobs if echo else c.logprobs
            out.append({"index": i, "text": text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                        "logprobs": completion_logprobs(lps) if body.logprobs is not None else None})
        return {"object": "text_completion", **meta, "choices": out, "usage": usage(choices, body.n)}

    async def _prompt_text(self, prompt: dict) -> str:
        if "text" in prompt:
            return prompt["text"]
        reply = await self.s.client.call(DetokenizeReq(rid=EngineClient.new_rid(), token_ids=prompt["token_ids"]))
        return reply.text if isinstance(reply, DetokenizeOut) else ""

    async def _completion_chunks(self, reqs, meta, body, echo) -> AsyncIterator[dict]:
        choices = [Choice() for _ in reqs]
        offset = [0] * len(reqs)  # text_offset where each choice's next chunk starts
        async for i, out in stream_choices(self.s.client, self.s.metrics, reqs, self.s.request_timeout):
            if echo and not choices[i].token_ids:  # a choice echoes once it runs (refusals stay HTTP errors)
                lp = completion_logprobs(out.prompt_logprobs) if body.logprobs is not None else None
                offset[i] = sum(len(e["token"]) for e in out.prompt_logprobs or [])
                yield {"object": "text_completion", **meta, "choices": [
                    {"index": i, "text": echo[i // body.n], "finish_reason": None, "logprobs": lp}]}
            choices[i].add(out)
            lp = completion_logprobs(out.logprobs, offset[i]) if body.logprobs is not None else None
            offset[i] += sum(len(e["token"]) for e in out.logprobs or [])
            yield {"object": "text_completion", **meta, "choices": [
                {"index": i, "text": out.text, "finish_reason": out.finish_reason if out.finished else None,
                 "logprobs": lp}]}
        if body.stream_options and body.stream_options.include_usage:
            yield {"object": "text_completion", **meta, "choices": [], "usage": usage(choices, body.n)}

    async def chat(self, body: ChatRequest):
        self._admit(body, body.n)
        max_tokens = body.max_completion_tokens or body.max_tokens
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, self.s.sampling_defaults, max_tokens or 1, top)
        messages = [m.model_dump() for m in body.messages]
        reqs = fan_out([{"messages": messages}], params, body.n, auto_max_tokens=max_tokens is None)
        meta = {"id": f"chatcmpl-{EngineClient.new_rid()}", "created": int(time.time()), "model": self.s.model_name}
        if body.stream:
            return await self._sse(self._chat_chunks(reqs, meta, body))
        choices = await collect(self.s.client, self.s.metrics, reqs, self.s.request_timeout)
        out = [{"index": i, "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "logprobs": chat_logprobs(c.logprobs) if body.logprobs else None} for i, c in enumerate(choices)]
        return {"object": "chat.completion", **meta, "choices": out, "usage": usage(choices, body.n)}

    async def _chat_chunks(self, reqs, meta, body) -> AsyncIterator[dict]:
        base = {"object": "chat.completion.chunk", **meta}
        choices = [Choice() for _ in reqs]
        started = False
        async for i, out in stream_choices(self.s.client, self.s.metrics, reqs, self.s.request_timeout):
            if not started:  # role chunks only once the request is accepted (errors stay HTTP errors)
                started = True
                for j in range(len(reqs)):
                    yield {**base, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None, "logprobs": None}]}
            choices[i].add(out)
            lp = chat_logprobs(out.logprobs) if body.logprobs else None
            delta = {"content": out.text} if out.text or not out.finished else {}
            yield {**base, "choices": [{"index": i, "delta": delta, "logprobs": lp,
                                        "finish_reason": out.finish_reason if out.finished else None}]}
        if body.stream_options and body.stream_options.include_usage:
            yield {**base, "choices": [], "usage": usage(choices, body.n)}

    @staticmethod
    async def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
        """Waits for the first chunk so a refused request is still an HTTP error, not a stream."""
        try:
            first = await anext(chunks)
        except StopAsyncIteration:
            first = None

        async def events():
            try:
                if first is not None:
                    yield f"data: {json.dumps(first)}\n\n"
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk)}\n\n"
            except APIError as e:
                yield f"data: {json.dumps(error_body(e.message, e.status, e.param))}\n\n"
            finally:
                await chunks.aclose()  # a disconnect lands here: abort what is still running
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def completion_logprobs(lps: list[dict] | None, start: int = 0) -> dict:
    """The legacy format keys top_logprobs by token text; where two tokens share a text (partial
    UTF-8), the likelier one's value is kept. Offsets count from `start`: a stream's chunks
    continue where the choice's text so far ends."""
    lps = lps or []
    offsets, pos = [], start
    for lp in lps:
        offsets.append(pos)
        pos += len(lp["token"])
    # A prompt's first token has no logprob (nothing precedes it): null, as OpenAI reports it.
    return {"tokens": [lp["token"] for lp in lps], "token_logprobs": [lp["logprob"] for lp in lps],
            "top_logprobs": [None if lp["logprob"] is None else {t[2]: t[1] for t in reversed(lp["top_logprobs"])}
                             for lp in lps], "text_offset": offsets}


def chat_logprobs(lps: list[dict] | None) -> dict:
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(lp["token"], lp["logprob"]),
                         "top_logprobs": [entry(t[2], t[1]) for t in lp["top_logprobs"]]} for lp in lps or []]}

