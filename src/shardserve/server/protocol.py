"""OpenAI request bodies (pydantic) and the error body every failure answers with."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Re-exported (the `as` form): the server's modules import it from here.
from shardserve.openai_errors import error_body as error_body

# Strict: a boolean is not a number nor a number a boolean, and 1.5 (or "1") is no integer, as
# JSON types say (an integer is still a fine float: temperature 1).
STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    # vLLM's: a `usage` (this choice's tokens so far) in every chunk, besides include_usage's last one.
    continuous_usage_stats: bool = False


# Fields of OpenAI's API that this server does not honour: name -> (the values that ask for
# nothing, why any other value is refused). A request setting one otherwise gets a 400 naming it;
# any field neither declared nor listed is refused as unrecognized (extra="forbid"). Nothing a
# request asks for is accepted and then ignored.
NOT_HONOURED: dict[str, tuple[tuple, str]] = {
    "store": ((False,), "this server stores no completions"),
    "metadata": (({},), "metadata tags stored completions, and this server stores none"),
    "service_tier": (("auto", "default"), "this server has one service tier ('auto' or 'default')"),
    "use_beam_search": ((False,), "beam search is not supported"),
}


class JsonSchemaSpec(BaseModel):
    """response_format.json_schema: the schema is enforced whether or not `strict` is set."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class RefusedField(Exception):
    """A known field set to a value this server does not honour (not a ValueError, so pydantic
    lets it through validation to parse_body, which answers a 400 naming `field`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field, self.message = field, message


class Refusing(BaseModel):
    """A request body: nulls read as absent, `not_honoured` fields refused unless they ask for nothing."""

    model_config = STRICT
    not_honoured: ClassVar[dict[str, tuple[tuple, str]]] = NOT_HONOURED

    @model_validator(mode="before")
    @classmethod
    def _nulls_and_refusals(cls, data: Any) -> Any:
        """OpenAI's API reads a null field as an absent one (clients send either); a field of
        `not_honoured` is refused unless its value asks for nothing, and then dropped."""
        if not isinstance(data, dict):
            return data
        for name, (fine, why) in cls.not_honoured.items():
            value = data.get(name)
            # By type too: 0 is not false, nor 1 true.
            if value is not None and not any(value == f and type(value) is type(f) for f in fine):
                raise RefusedField(name, f"{name!r} is not supported: {why}")
        return {k: v for k, v in data.items() if v is not None and k not in cls.not_honoured}


class _Sampling(Refusing):
    model: str | None = None
    n: int = 1
    # None: the model's generation defaults (see loader/generation_config.py), else SamplingParams'.
    # OpenAI's range: a temperature above 2 is a 400, as its API answers.
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for abuse monitoring: nothing to do with it here
    # Token id (a string in JSON) -> bias in [-100, 100], added to the logits before sampling.
    logit_bias: dict[str, float] | None = None
    # Structured outputs (server/structured.py): OpenAI's response_format, or one of the extension
    # fields SGLang accepts (`regex`, `ebnf`) and `grammar` (EBNF or Lark), as vLLM's key names it.
    response_format: ResponseFormat | None = None
    regex: str | None = None
    grammar: str | None = None
    ebnf: str | None = None
    # vLLM's older names for the same (guided_choice: one of these strings), and its newer object.
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None
    # vLLM's sampling extras (sampling_params.SamplingParams says what each does).
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # -1: the model's context
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N"
    priority: int = 0  # lower first under --scheduling-policy priority; else only 0
    request_id: str | None = Field(None, min_length=1)  # the response's id and the engine's rid prefix


class CompletionRequest(_Sampling):
    not_honoured: ClassVar[dict[str, tuple[tuple, str]]] = {
        **NOT_HONOURED, "suffix": (("",), "inserting text before a suffix needs a fill-in-the-middle model"),
    }

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16  # 0 only with echo: score the prompt, generate nothing
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None  # accepted only equal to n (vLLM's V1 engine has no best_of either)
    add_special_tokens: bool = True  # a text prompt's BOS etc.


class ChatMessage(BaseModel):
    """Checked and shaped for the chat template by chat_messages.normalize_messages; keys beyond
    these (tool_calls, tool_call_id, name, ...) are passed on for the template to read."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Any = None  # a string, an array of text parts, or null beside an assistant's tool_calls


class FunctionDefinition(BaseModel):
    model_config = STRICT

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None  # true: the arguments are held to the schema (server/tools.py)


class ToolDefinition(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionName


RESERVED_TEMPLATE_KWARGS = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
))


class ChatTemplateFields(BaseModel):
    """What a chat's prompt is rendered with (chat completions and /tokenize alike)."""

    model_config = STRICT

    # The chat template (vLLM's fields): a Jinja string in place of the model's, the variables it
    # reads beyond the messages (enable_thinking, ...), and how the prompt ends: ready for a new
    # assistant message, or continuing the last one (not both).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = Field(None, min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, kwargs: dict | None) -> dict | None:
        """Variables for the template; not apply_chat_template's own options, which would change
        what it returns (or, as fields of this request, have a field of their own)."""
        taken = sorted(set(kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise ValueError(f"{taken[0]!r} is not a template variable: use the request's own field or none")
        return kwargs


class ChatRequest(_Sampling, ChatTemplateFields):
    not_honoured: ClassVar[dict[str, tuple[tuple, str]]] = {
        **NOT_HONOURED,
        "modalities": ((["text"],), "this model produces text only"),
        "audio": ((), "this model produces text only"),
        "prediction": ((), "predicted outputs are not supported"),
        "web_search_options": ((), "this server cannot search the web"),
        "functions": ((), "the deprecated functions API is not supported; use tools"),
        "function_call": ((), "the deprecated functions API is not supported; use tool_choice"),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Tool calling (server/tools.py): definitions for the chat template, read back with --tool-call-parser.
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # A reasoning model's thinking held to at most this many tokens, then </think> (by grammar;
    # the Messages API's thinking.budget_tokens comes here).
    thinking_budget: int | None = Field(None, ge=1)


class TokenizeRequest(ChatTemplateFields):
    model_config = STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    tools: list[ToolDefinition] | None = None  # with messages: rendered by the chat template


class DetokenizeRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    tokens: list[int]
