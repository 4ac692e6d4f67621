"""A request's admission and, for a chat, its engine sub-requests: what chat completions, the
Responses API and the Messages API share. The latter two translate their bodies into a
ChatRequest and take the same path from there (same checks, limits, tools and reasoning)."""

from __future__ import annotations

import asyncio
import dataclasses

from shardserve.chat_messages import TEXT_ONLY, ChatMessageError, image_parts, normalize_messages
from shardserve.ipc.messages.api import GenerateReq
from shardserve.sampling_params import LoRARequest, SamplingParams
from shardserve.server.client import EngineClient
from shardserve.server.errors import APIError
from shardserve.server.protocol import ChatMessage, ChatRequest
from shardserve.server.reasoning import Reasoning
from shardserve.server.request_params import chat_options, check_scheduling, sampling_params
from shardserve.server.tools import ToolUse, chat_tool_use
from shardserve.tokenizer.images import ImageError


def chat_messages(messages: list[ChatMessage], images_refused: str = TEXT_ONLY) -> list[dict]:
    """The conversation as the chat template reads it (chat_messages.py), or a 400 naming the
    message part at fault. `images_refused`: ServerState's."""
    try:
        return normalize_messages([m.model_dump() for m in messages], images_refused)
    except ChatMessageError as e:
        raise APIError(400, str(e), param=e.param) from None


async def fetch_images(s, messages: list[dict] | None) -> None:
    """Each image part of normalized `messages` given by http(s) URL, fetched (in threads, side by
    side, by ServerState.media's rules) and put back as a data: URL; a 400 naming messages if one
    cannot be. The tokenizer processes then decode data: URLs only, and never wait on a network."""
    parts = [p for p in image_parts(messages or []) if not p["url"].startswith("data:")]
    if not parts:
        return
    try:
        urls = await asyncio.gather(*(asyncio.to_thread(s.media.as_data_url, p["url"]) for p in parts))
    except ImageError as e:
        raise APIError(400, str(e), param="messages") from None
    for part, url in zip(parts, urls):
        part["url"] = url


def completion_prompts(prompt, param: str = "prompt") -> list[dict]:
    """A completions prompt (or embeddings input, `param`): text, token ids, or a list of either."""
    if isinstance(prompt, str):
        prompts = [{"text": prompt}]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [{"token_ids": prompt}]
    else:
        prompts = [{"text": p} if isinstance(p, str) else {"token_ids": p} for p in prompt]
    if not prompts or any(not (p.get("text") or p.get("token_ids")) for p in prompts):
        raise APIError(400, f"the {param} is empty", param=param)
    return prompts


def fan_out(prompts: list[dict], params: SamplingParams, n: int, request_id: str | None = None,
            **extra) -> list[GenerateReq]:
    """prompts x n sub-requests, choice index = prompt * n + sample; sample i gets seed + i. A
    client's request_id prefixes each engine id (which stays unique should the client reuse it)."""
    reqs = []
    for p in prompts:
        for i in range(n):
            one = dataclasses.replace(params, seed=params.sample_seed(i))
            rid = f"{request_id}-{EngineClient.new_rid()}" if request_id else EngineClient.new_rid()
            reqs.append(GenerateReq(rid=rid, params=one, **p, **extra))
    return reqs


def check_model(s, model: str | None) -> LoRARequest | None:
    """The LoRA adapter a request's `model` names, None for this server's base model; a 404 for any
    other name (`s`: the ServerState)."""
    return s.loras.resolve(model)


def served_name(s, lora: LoRARequest | None) -> str:
    """The model an answer names: the adapter the request ran with, else the base model."""
    return lora.lora_name if lora is not None else s.model_name


def check_queue(s, count: int) -> None:
    """Room for `count` more engine requests under --max-queued-requests, else a 503 at once."""
    if s.client.num_active + count > s.max_queued:
        raise APIError(503, "the server is at its queue limit; retry later", headers={"Retry-After": "1"})


def admit(s, body, count: int) -> LoRARequest | None:
    """The checks every generating request passes first; `s`: the ServerState, `count`: its
    sub-requests. Returns the adapter its `model` names (None: the base model)."""
    lora = check_model(s, body.model)
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
    check_scheduling(body, s.scheduling_policy)
    check_queue(s, count)
    return lora


def reasoning_for(reasoning: Reasoning, body: ChatRequest) -> Reasoning:
    """The server's parser as this request's prompt leaves it: a continued message (a prefill) is
    its own text, not thinking; `enable_thinking: false` closes the thinking in the prompt."""
    if body.continue_final_message:
        return Reasoning()
    if (body.chat_template_kwargs or {}).get("enable_thinking") is False:
        return dataclasses.replace(reasoning, template_opens=False)
    return reasoning


def chat_turn(s, body: ChatRequest, prefill: str = "") -> tuple[list[GenerateReq], ToolUse]:
    """A chat request's engine sub-requests (n of them) and what its tools (and the server's
    reasoning parser) make of the output."""
    lora = admit(s, body, body.n)
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(body, field)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"{field} must be >= 1, got {max_tokens}", param=field)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    top = (body.top_logprobs or 0) if body.logprobs else None
    tools = chat_tool_use(body, s.tool_format, reasoning_for(s.reasoning, body))
    if body.thinking_budget is not None:
        if s.reasoning.name is None:
            raise APIError(400, "a thinking budget needs a reasoning model: start the server with --reasoning-parser",
                           param="thinking_budget")
        tools = dataclasses.replace(tools, thinking_budget=body.thinking_budget)
    # Without max_tokens the scheduler gives whatever context the prompt leaves (min_tokens till then).
    params = tools.constrain(sampling_params(body, s.sampling_defaults, max_tokens or max(1, body.min_tokens),
                                             top, body.prompt_logprobs, s.vocab_size, s.max_model_len, lora))
    messages = chat_messages(body.messages, s.images_refused)
    reqs = fan_out([{"messages": messages, "tools": tools.tools}], params, body.n, body.request_id,
                   auto_max_tokens=max_tokens is None, prefill=prefill,
                   chat_options=chat_options(body, messages, s.trust_request_chat_template))
    return reqs, tools
