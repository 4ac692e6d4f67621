"""/v1/completions and /v1/chat/completions: requests in, OpenAI-shaped JSON or SSE out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import msgspec
from fastapi.responses import StreamingResponse

from shardserve.ipc.messages.api import DetokenizeOut, DetokenizeReq, GenerateReq, TextOut
from shardserve.server.client import EngineClient
from shardserve.server.errors import APIError
from shardserve.server.generation import Choice, collect, stream_choices, usage
from shardserve.server.logprobs import as_token_ids, chat_logprobs, completion_logprobs, prompt_logprobs
from shardserve.server.protocol import ChatRequest, CompletionRequest, error_body
from shardserve.server.request_params import sampling_params
from shardserve.server.sse import data, sse
from shardserve.server.tools import ToolUse, finish_reason
from shardserve.server.turns import admit, chat_turn, completion_prompts, fan_out, fetch_images, served_name


class OpenAIHandlers:
    def __init__(self, state):
        self.s = state

    async def completions(self, body: CompletionRequest, prefill: str = ""):
        """`prefill` (a decode instance): the prefill instance that computes each prompt."""
        prompts = completion_prompts(body.prompt)
        lora = admit(self.s, body, len(prompts) * body.n)
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, f"best_of ({body.best_of}) other than n ({body.n}) is not supported: ask for n "
                                f"samples with logprobs and rank them", param="best_of")
        # max_tokens 0 with echo scores the prompt and generates nothing (the legacy API's way to
        # score a text, which evaluation tools use). As vLLM does, the engine samples one token
        # (it needs max_tokens >= 1), which the answer drops.
        score_only = body.max_tokens == 0
        if score_only and not body.echo:
            raise APIError(400, "max_tokens must be >= 1 (0, generating nothing, only with echo to score the prompt)",
                           param="max_tokens")
        if body.echo and body.truncate_prompt_tokens is not None:
            raise APIError(400, "echo repeats the prompt as given, so it cannot be truncated "
                                "(truncate_prompt_tokens)", param="truncate_prompt_tokens")
        # echo + logprobs scores the prompt too, as OpenAI's legacy completions do.
        scored = _most(body.logprobs if body.echo else None, body.prompt_logprobs)
        params = sampling_params(body, self.s.sampling_defaults, 1 if score_only else body.max_tokens, body.logprobs,
                                 scored, self.s.vocab_size, self.s.max_model_len, lora)
        reqs = fan_out(prompts, params, body.n, body.request_id, prefill=prefill,
                       add_special_tokens=body.add_special_tokens)
        echo = [await self._prompt_text(p, body.skip_special_tokens) for p in prompts] if body.echo else None
        meta = {"id": f"cmpl-{body.request_id or EngineClient.new_rid()}", "created": int(time.time()),
                "model": served_name(self.s, lora)}
        if body.stream:
            return await self._sse(self._completion_chunks(reqs, meta, body, echo, score_only))
        choices = await self._collect(reqs, body)
        out = []
        for i, c in enumerate(choices):
            if score_only:
                c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason = "", [], [], "length", None
            text = (echo[i // body.n] if echo else "") + c.text
            lps = (c.prompt_logprobs or []) + c.logprobs if echo else c.logprobs
            out.append({"index": i, "text": text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                        "logprobs": completion_logprobs(lps, k=body.logprobs) if body.logprobs is not None else None,
                        **_prompt_lps(c.prompt_logprobs, body.prompt_logprobs)})
        return {"object": "text_completion", **meta, "choices": out, "usage": usage(choices, body.n)}

    async def _collect(self, reqs: list[GenerateReq], body) -> list[Choice]:
        choices = await collect(self.s.client, self.s.metrics, reqs, self.s.request_timeout)
        if body.return_tokens_as_token_ids:
            for c in choices:
                c.logprobs, c.prompt_logprobs = as_token_ids(c.logprobs), as_token_ids(c.prompt_logprobs)
        return choices

    async def _prompt_text(self, prompt: dict, skip_special_tokens: bool) -> str:
        if "text" in prompt:
            return prompt["text"]
        reply = await self.s.client.call(DetokenizeReq(rid=EngineClient.new_rid(), token_ids=prompt["token_ids"],
                                                       skip_special_tokens=skip_special_tokens))
        return reply.text if isinstance(reply, DetokenizeOut) else ""

    async def _completion_chunks(self, reqs, meta, body, echo, score_only: bool) -> AsyncIterator[dict]:
        choices = [Choice() for _ in reqs]
        offset = [0] * len(reqs)  # text_offset where each choice's next chunk starts
        echoed = [False] * len(reqs)
        every, last = _usage_options(body)
        base = {"object": "text_completion", **meta}
        async for i, out in stream_choices(self.s.client, self.s.metrics, reqs, self.s.request_timeout):
            out = _renamed(out, body.return_tokens_as_token_ids)
            if score_only:  # the one token sampled is not part of the answer
                out = _nothing_generated(out)
            plps = _prompt_lps(out.prompt_logprobs, body.prompt_logprobs)  # with a choice's first output
            if echo and not echoed[i]:  # a choice echoes once it runs (refusals stay HTTP errors)
                echoed[i] = True
                lp = completion_logprobs(out.prompt_logprobs, k=body.logprobs) if body.logprobs is not None else None
                offset[i] = sum(len(e["token"]) for e in out.prompt_logprobs or [])
                yield {**base, "choices": [{"index": i, "text": echo[i // body.n], "finish_reason": None,
                                            "logprobs": lp, **plps}], **_so_far(every, out, choices[i])}
                plps = {}
            choices[i].add(out)
            lp = completion_logprobs(out.logprobs, offset[i]) if body.logprobs is not None else None
            offset[i] += sum(len(e["token"]) for e in out.logprobs or [])
            yield {**base, "choices": [{"index": i, "text": out.text, "logprobs": lp, **plps,
                                        "finish_reason": out.finish_reason if out.finished else None}],
                   **_so_far(every, out, choices[i])}
        if last:
            yield {**base, "choices": [], "usage": usage(choices, body.n)}

    async def chat(self, body: ChatRequest, prefill: str = ""):
        reqs, tools = chat_turn(self.s, body, prefill)
        await fetch_images(self.s, reqs[0].messages)  # the n sub-requests share one conversation
        meta = {"id": f"chatcmpl-{body.request_id or EngineClient.new_rid()}", "created": int(time.time()),
                "model": served_name(self.s, reqs[0].params.lora_request)}
        if body.stream:
            return await self._sse(self._chat_chunks(reqs, meta, body, tools))
        choices = await self._collect(reqs, body)
        out = []
        for i, c in enumerate(choices):
            message, called = tools.message(c.text)
            out.append({"index": i, "message": message, "finish_reason": finish_reason(c.finish_reason, called),
                        "stop_reason": c.stop_reason, "logprobs": chat_logprobs(c.logprobs) if body.logprobs else None})
        # vLLM answers the (one) prompt's logprobs beside the choices.
        return {"object": "chat.completion", **meta, "choices": out, "usage": usage(choices, body.n),
                **_prompt_lps(choices[0].prompt_logprobs, body.prompt_logprobs)}

    async def _chat_chunks(self, reqs, meta, body, tools: ToolUse) -> AsyncIterator[dict]:
        base = {"object": "chat.completion.chunk", **meta}
        choices = [Choice() for _ in reqs]
        streams = [tools.stream() for _ in reqs]  # text -> content or tool-call deltas
        held: list[list[dict]] = [[] for _ in reqs]  # logprobs of tokens whose text is not out yet
        plps: list[dict] = [{} for _ in reqs]  # prompt logprobs not sent yet
        every, last = _usage_options(body)
        started = False
        async for i, out in stream_choices(self.s.client, self.s.metrics, reqs, self.s.request_timeout):
            out = _renamed(out, body.return_tokens_as_token_ids)
            if not started:  # role chunks only once the request is accepted (errors stay HTTP errors)
                started = True
                for j in range(len(reqs)):
                    yield {**base, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None, "logprobs": None}],
                           **_so_far(every, out, Choice())}
            choices[i].add(out)
            plps[i] = plps[i] or _prompt_lps(out.prompt_logprobs, body.prompt_logprobs)
            deltas = streams[i].deltas(out.text, out.finished)
            if not deltas and not out.finished:
                # No text yet (a partial character, a stop string that may be forming, a skipped
                # special token, text that may be a tool-call tag): no empty chunk; the tokens'
                # logprobs go with the next text.
                held[i].extend(out.logprobs or [])
                continue
            lps, held[i] = held[i] + (out.logprobs or []), []
            lp = chat_logprobs(lps) if body.logprobs else None
            finish = finish_reason(out.finish_reason, streams[i].called) if out.finished else None
            deltas = deltas or [{}]
            for k, delta in enumerate(deltas):
                yield {**base, "choices": [{"index": i, "delta": delta, "logprobs": lp if k == 0 else None,
                                            "finish_reason": finish if k == len(deltas) - 1 else None}],
                       **(plps[i] if k == 0 else {}), **_so_far(every, out, choices[i])}
            plps[i] = {}
        if last:
            yield {**base, "choices": [], "usage": usage(choices, body.n)}

    @staticmethod
    async def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
        return await sse(chunks, data, lambda e: data(error_body(e.message, e.status, e.param)), "data: [DONE]\n\n")


def _most(a: int | None, b: int | None) -> int | None:
    """The larger of two top-k asks (either may be None: not asked)."""
    return b if a is None else a if b is None else max(a, b)


def _prompt_lps(lps: list[dict] | None, k: int | None) -> dict:
    """{"prompt_logprobs": ...} where the request asked for them and they came, else nothing."""
    return {"prompt_logprobs": prompt_logprobs(lps, k)} if k is not None and lps is not None else {}


def _usage_options(body) -> tuple[bool, bool]:
    """(usage in every chunk: vLLM's continuous_usage_stats, a last chunk with it: include_usage)."""
    so = body.stream_options
    return (so is not None and so.continuous_usage_stats), (so is not None and so.include_usage)


def _so_far(every: bool, out: TextOut, c: Choice) -> dict:
    """With continuous_usage_stats: this choice's prompt and its tokens so far."""
    if not every:
        return {}
    done = len(c.token_ids)
    return {"usage": {"prompt_tokens": out.prompt_tokens, "completion_tokens": done,
                      "total_tokens": out.prompt_tokens + done}}


def _renamed(out: TextOut, as_ids: bool) -> TextOut:
    if not as_ids:
        return out
    return msgspec.structs.replace(out, logprobs=as_token_ids(out.logprobs),
                                   prompt_logprobs=as_token_ids(out.prompt_logprobs))


def _nothing_generated(out: TextOut) -> TextOut:
    """A scoring request's output without the token the engine had to sample."""
    return msgspec.structs.replace(out, text="", new_ids=[], logprobs=[], finish_reason="length", stop_reason=None)

