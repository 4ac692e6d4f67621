"""A request body's fields as the engine's SamplingParams and the chat template's options, or a
400 naming the field at fault."""

from __future__ import annotations

from shardserve.chat_messages import ChatMessageError, check_template_options
from shardserve.sampling_params import LoRARequest, SamplingParams
from shardserve.server.errors import APIError
from shardserve.server.structured import structured_outputs

MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_params(body, defaults: dict, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None, vocab_size: int | None = None,
                    max_model_len: int | None = None, lora: LoRARequest | None = None) -> SamplingParams:
    """The request's fields; those it leaves out come from `defaults` (the model's), else
    SamplingParams' own. `lora`: the adapter its `model` named."""
    given = {k: getattr(body, k) for k in MODEL_DEFAULTED if getattr(body, k) is not None}
    bias = logit_bias(body.logit_bias, vocab_size)
    check_token_ids(body.allowed_token_ids, vocab_size, "allowed_token_ids")
    guided = structured_outputs(body)  # a 400 naming its field when it cannot compile
    # vLLM's -1: as much of the prompt as the context holds.
    truncate = max_model_len if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
    try:
        return SamplingParams(
            **{**defaults, **given}, n=1, max_tokens=max_tokens, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, seed=body.seed, stop=body.stop or [],
            stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=body.skip_special_tokens, logit_bias=bias,
            structured_outputs=guided, min_tokens=body.min_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            allowed_token_ids=body.allowed_token_ids, bad_words=body.bad_words, truncate_prompt_tokens=truncate,
            lora_request=lora, priority=getattr(body, "priority", 0),
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
        check_token_ids([int(key)], vocab_size, "logit_bias")
        out[int(key)] = value
    return out


def check_token_ids(ids: list[int] | None, vocab_size: int | None, field: str) -> None:
    """Ids the sampler would have to drop (beyond the logits) are a 400 here instead."""
    bad = [t for t in ids or () if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        vocab = f"[0, {vocab_size})" if vocab_size is not None else "(ids are not negative)"
        raise APIError(400, f"{field} token id {bad[0]} is outside the vocabulary {vocab}", param=field)


def chat_options(body, messages: list[dict], trust_template: bool) -> dict:
    """The chat template's options (chat_messages.render_chat) from the request's fields; a
    request's own template only where the server trusts them (--trust-request-chat-template)."""
    if body.chat_template is not None and not trust_template:
        raise APIError(400, "this server runs only its model's chat template; start it with "
                            "--trust-request-chat-template to run the one a request sends", param="chat_template")
    options = {"add_generation_prompt": body.add_generation_prompt,
               "continue_final_message": body.continue_final_message,
               "chat_template": body.chat_template, "chat_template_kwargs": body.chat_template_kwargs}
    options = {k: v for k, v in options.items() if v is not None}
    try:
        check_template_options(messages, options)
    except ChatMessageError as e:
        raise APIError(400, str(e), param=e.param) from None
    return options


def template_fields_given(body) -> str | None:
    """The first chat template field a request sets to other than its default, if any."""
    defaults = {"add_generation_prompt": True, "continue_final_message": False, "chat_template": None,
                "chat_template_kwargs": None}
    return next((name for name, d in defaults.items() if getattr(body, name) != d), None)


def check_scheduling(body, policy: str) -> None:
    """`policy`: the server's --scheduling-policy."""
    if body.priority != 0 and policy != "priority":
        raise APIError(400, f"priority {body.priority} needs priority scheduling; this server schedules first "
                            f"come, first served (start it with --scheduling-policy priority, as vLLM's)",
                       param="priority")
