"""/v1/completions and /v1/chat/completions: requests in, OpenAI-shaped JSON or SSE out."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator

import msgspec
from fastapi.responses import StreamingResponse

from shardserve.chat_messages import ChatMessageError, normalize_messages
from shardserve.core import SamplingParams
from shardserve.ipc.messages.api import DetokenizeOut, DetokenizeReq, GenerateReq, TextOut
from shardserve.server.client import EngineClient
from shardserve.server.errors import APIError
from shardserve.server.generation import Choice, collect, stream_choices, usage
from shardserve.server.protocol import ChatMessage, ChatRequest, CompletionRequest, error_body
from shardserve.server.structured import structured_outputs
from shardserve.server.tools import ToolUse, finish_reason, tool_use

MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_params(body, defaults: dict, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None, vocab_size: int | None = None) -> SamplingParams:
    """The request's fields; those it leaves out come from `defaults` (the model's), else
    SamplingParams' own."""
    given = {k: getattr(body, k) for k in MODEL_DEFAULTED if getattr(body, k) is not None}
    bias = logit_bias(body.logit_bias, vocab_size)
    guided = structured_outputs(body)  # a 400 naming its field when it cannot compile
    try:
        return SamplingParams(
            **{**defaults, **given}, n=1, max_tokens=max_tokens, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, seed=body.seed, stop=body.stop or [],
            stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=body.skip_special_tokens, logit_bias=bias,
            structured_outputs=guided,
        )
    except ValueError as e:
        param = str(e).split(".", 1)[1].split(" ", 1)[0] if str(e).startswith("SamplingParams.") else None
        raise APIError(400, str(e).removeprefix("SamplingParams."), param=param) from None


def logit_bias(raw: dict[str, float] | None, vocab_size: int | None) -> dict[int, float] | None:
    """JSON's string keys as token ids, each checked against the vocabulary (the engine checks
    again); SamplingParams checks the biases."""
    if not raw:
        return None
    out = {}
    for key, value in raw.items():
        if not (key.isascii() and key.isdigit()):
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        if vocab_size is not None and int(key) >= vocab_size:
            raise APIError(400, f"logit_bias token id {int(key)} is outside the vocabulary [0, {vocab_size})",
                           param="logit_bias")
        out[int(key)] = value
    return out


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """The conversation as the chat template reads it (chat_messages.py), or a 400 naming the
    message part at fault."""
    try:
        return normalize_messages([m.model_dump() for m in messages])
    except ChatMessageError as e:
        raise APIError(400, str(e), param=e.param) from None


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
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        if s.client.num_active + count > s.max_queued:
            raise APIError(503, "the server is at its queue limit; retry later", headers={"Retry-After": "1"})

    async def completions(self, body: CompletionRequest, prefill: str = ""):
        """`prefill` (a decode instance): the prefill instance that computes each prompt."""
        prompts = completion_prompts(body.prompt)
        self._admit(body, len(prompts) * body.n)
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
        # echo + logprobs scores the prompt too, as OpenAI's legacy completions do.
        params = sampling_params(body, self.s.sampling_defaults, 1 if score_only else body.max_tokens, body.logprobs,
                                 body.logprobs if body.echo else None, self.s.vocab_size)
        reqs = fan_out(prompts, params, body.n, prefill=prefill)
        echo = [await self._prompt_text(p, body.skip_special_tokens) for p in prompts] if body.echo else None
        meta = {"id": f"cmpl-{EngineClient.new_rid()}", "created": int(time.time()), "model": self.s.model_name}
        if body.stream:
            return await self._sse(self._completion_chunks(reqs, meta, body, echo, score_only))
        choices = await collect(self.s.client, self.s.metrics, reqs, self.s.request_timeout)
        out = []
        for i, c in enumerate(choices):
            if score_only:
                c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason = "", [], [], "length", None
            text = (echo[i // body.n] if echo else "") + c.text
            lps = (c.prompt_logprobs or []) + c.logprobs if echo else c.logprobs
            out.append({"index": i, "text": text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                        "logprobs": completion_logprobs(lps) if body.logprobs is not None else None})
        return {"object": "text_completion", **meta, "choices": out, "usage": usage(choices, body.n)}

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
        async for i, out in stream_choices(self.s.client, self.s.metrics, reqs, self.s.request_timeout):
            if score_only:  # the one token sampled is not part of the answer
                out = _nothing_generated(out)
            if echo and not echoed[i]:  # a choice echoes once it runs (refusals stay HTTP errors)
                echoed[i] = True
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

    async def chat(self, body: ChatRequest, prefill: str = ""):
        self._admit(body, body.n)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(body, field)
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"{field} must be >= 1, got {max_tokens}", param=field)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        top = (body.top_logprobs or 0) if body.logprobs else None
        tools = tool_use(body, self.s.tool_call_parser)
        params = tools.constrain(sampling_params(body, self.s.sampling_defaults, max_tokens or 1, top,
                                                 vocab_size=self.s.vocab_size))
        messages = chat_messages(body.messages)
        reqs = fan_out([{"messages": messages, "tools": tools.tools}], params, body.n,
                       auto_max_tokens=max_tokens is None, prefill=prefill)
        meta = {"id": f"chatcmpl-{EngineClient.new_rid()}", "created": int(time.time()), "model": self.s.model_name}
        if body.stream:
            return await self._sse(self._chat_chunks(reqs, meta, body, tools))
        choices = await collect(self.s.client, self.s.metrics, reqs, self.s.request_timeout)
        out = []
        for i, c in enumerate(choices):
            message, called = tools.message(c.text)
            out.append({"index": i, "message": message, "finish_reason": finish_reason(c.finish_reason, called),
                        "stop_reason": c.stop_reason, "logprobs": chat_logprobs(c.logprobs) if body.logprobs else None})
        return {"object": "chat.completion", **meta, "choices": out, "usage": usage(choices, body.n)}

    async def _chat_chunks(self, reqs, meta, body, tools: ToolUse) -> AsyncIterator[dict]:
        base = {"object": "chat.completion.chunk", **meta}
        choices = [Choice() for _ in reqs]
        streams = [tools.stream() for _ in reqs]  # text -> content or tool-call deltas
        held: list[list[dict]] = [[] for _ in reqs]  # logprobs of tokens whose text is not out yet
        started = False
        async for i, out in stream_choices(self.s.client, self.s.metrics, reqs, self.s.request_timeout):
            if not started:  # role chunks only once the request is accepted (errors stay HTTP errors)
                started = True
                for j in range(len(reqs)):
                    yield {**base, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None, "logprobs": None}]}
            choices[i].add(out)
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
                                            "finish_reason": finish if k == len(deltas) - 1 else None}]}
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
            "top_logprobs": [_top_by_text(lp) for lp in lps], "text_offset": offsets}


def _top_by_text(lp: dict) -> dict | None:
    """The top k, likeliest first, then the sampled (or prompt) token if it is not among them:
    up to k + 1 entries, as OpenAI and vLLM answer (so logprobs 0 gives the token itself)."""
    if lp["logprob"] is None:  # a prompt's first token
        return None
    top: dict[str, float] = {}
    for t in lp["top_logprobs"]:
        top.setdefault(t[2], t[1])
    if not _in_top(lp):
        top.setdefault(lp["token"], lp["logprob"])
    return top


def _in_top(lp: dict) -> bool:
    return any(t[0] == lp["token_id"] for t in lp["top_logprobs"])


def chat_logprobs(lps: list[dict] | None) -> dict:
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def top(lp: dict) -> list[dict]:
        # top_logprobs 0 asks for none; with k > 0 the sampled token is added when not in the top k.
        out = [entry(t[2], t[1]) for t in lp["top_logprobs"]]
        return out + [entry(lp["token"], lp["logprob"])] if out and not _in_top(lp) else out

    return {"content": [{**entry(lp["token"], lp["logprob"]), "top_logprobs": top(lp)} for lp in lps or []]}


def _nothing_generated(out: TextOut) -> TextOut:
    """A scoring request's output without the token the engine had to sample."""
    return msgspec.structs.replace(out, text="", new_ids=[], logprobs=[], finish_reason="length", stop_reason=None)

