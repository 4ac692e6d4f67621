"""OpenAI request bodies (pydantic) and the error body every failure answers with."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Re-exported (the `as` form): the server's modules import it from here.
from shardserve.openai_errors import error_body as error_body


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


# Fields of OpenAI's API that this server does not honour: name -> (the values that ask for
# nothing, why any other value is refused). A request setting one otherwise gets a 400 naming it;
# any field neither declared nor listed is refused as unrecognized (extra="forbid"). Nothing a
# request asks for is accepted and then ignored.
NOT_HONOURED: dict[str, tuple[tuple, str]] = {
    "store": ((False,), "this server stores no completions"),
    "metadata": (({},), "metadata tags stored completions, and this server stores none"),
    "service_tier": (("auto", "default"), "this server has one service tier ('auto' or 'default')"),
}


class JsonSchemaSpec(BaseModel):
    """response_format.json_schema: the schema is enforced whether or not `strict` is set."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class RefusedField(Exception):
    """A known field set to a value this server does not honour (not a ValueError, so pydantic
    lets it through validation to parse_body, which answers a 400 naming `field`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field, self.message = field, message


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    not_honoured: ClassVar[dict[str, tuple[tuple, str]]] = NOT_HONOURED

    @model_validator(mode="before")
    @classmethod
    def _nulls_and_refusals(cls, data: Any) -> Any:
        """OpenAI's API reads a null field as an absent one (clients send either); a field of
        `not_honoured` is refused unless its value asks for nothing, and then dropped."""
        if not isinstance(data, dict):
            return data
        for name, (fine, why) in cls.not_honoured.items():
            if data.get(name) is not None and data[name] not in fine:
                raise RefusedField(name, f"{name!r} is not supported: {why}")
        return {k: v for k, v in data.items() if v is not None and k not in cls.not_honoured}

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


class CompletionRequest(_Sampling):
    not_honoured: ClassVar[dict[str, tuple[tuple, str]]] = {
        **NOT_HONOURED, "suffix": (("",), "inserting text before a suffix needs a fill-in-the-middle model"),
    }

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16  # 0 only with echo: score the prompt, generate nothing
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None  # accepted only equal to n (vLLM's V1 engine has no best_of either)


class ChatMessage(BaseModel):
    """Checked and shaped for the chat template by chat_messages.normalize_messages; keys beyond
    these (tool_calls, tool_call_id, name, ...) are passed on for the template to read."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Any = None  # a string, an array of text parts, or null beside an assistant's tool_calls


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None  # true: the arguments are held to the schema (server/tools.py)


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


class ChatRequest(_Sampling):
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


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    tools: list[ToolDefinition] | None = None  # with messages: rendered by the chat template


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]
