"""OpenAI Responses API request bodies (pydantic), as the `openai` SDK sends them.

Every field is honoured or refused with a 400 naming it: unknown fields are refused
(extra="forbid"); known ones this server cannot honour are refused unless their value asks for
nothing (NOT_HONOURED). Input items are checked where they are turned into chat messages
(responses_chat.py), which names the item at fault.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel as _Base
from pydantic import ConfigDict, Field, model_validator

from shardserve.server.protocol import STRICT, RefusedField, Refusing

BUILT_IN = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
            "computer", "image_generation", "local_shell", "shell", "mcp", "custom", "apply_patch", "tool_search")


class FunctionTool(_Base):
    model_config = STRICT

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # true: the arguments are held to the schema by grammar


class FunctionChoice(_Base):
    model_config = STRICT

    type: Literal["function"]
    name: str


class TextFormat(_Base):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is enforced whether or not strict is set


class TextConfig(_Base):
    model_config = STRICT

    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # no model here has another verbosity


class ReasoningConfig(Refusing):
    not_honoured: ClassVar[dict[str, tuple[tuple, str]]] = {
        "effort": ((), "no model served here trades effort for quality on request"),
        "summary": ((), "no model served here summarizes its thinking (the thinking itself comes back as "
                        "reasoning items, with --reasoning-parser)"),
        "generate_summary": ((), "no model served here summarizes its thinking"),
    }


class ResponsesRequest(Refusing):
    not_honoured: ClassVar[dict[str, tuple[tuple, str]]] = {
        "background": ((False,), "background responses are not supported: stream it, or wait for it"),
        "truncation": (("disabled",), "only 'disabled': a conversation longer than the context is a 400"),
        "service_tier": (("auto", "default"), "this server has one service tier ('auto' or 'default')"),
        "include": (([],), "nothing extra can be included: no encrypted reasoning, logprobs or tool outputs"),
        "max_tool_calls": ((), "the number of tool calls is the client's to limit"),
        "conversation": ((), "conversations are not stored: continue with previous_response_id"),
        "prompt": ((), "stored prompt templates are not supported"),
        "context_management": ((), "the context is not compacted: the conversation must fit"),
        "top_logprobs": ((0,), "logprobs are not returned on responses; use chat completions"),
        "moderation": ((), "this server runs no moderation"),
        "image": ((), "give images as input_image parts of the input"),
    }

    @model_validator(mode="before")
    @classmethod
    def _refusals(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        reasoning = data.get("reasoning")
        for key, (_, why) in ReasoningConfig.not_honoured.items():
            if isinstance(reasoning, dict) and reasoning.get(key) is not None:
                raise RefusedField(f"reasoning.{key}", f"reasoning.{key} is not supported: {why}")
        tools = data.get("tools")
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            kind = kind if isinstance(kind, str) else None
            if kind != "function":
                built_in = kind is not None and kind.startswith(BUILT_IN)
                why = "built-in tools run on OpenAI's servers" if built_in else "only function tools are"
                raise RefusedField(f"tools.{i}", f"tool type {kind!r} is not supported: {why}")
        return data

    model: str | None = None
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = Field(None, max_length=16)
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    user: str | None = None  # an end-user id for abuse monitoring: nothing to do with it here
    safety_identifier: str | None = None  # the same
    # A cache-routing hint: the prefix cache keys on the prompt itself, so every prompt is cached.
    prompt_cache_key: str | None = None
    stream_options: dict[Literal["include_obfuscation"], Literal[False]] | None = None
    # vLLM's: variables for the chat template (enable_thinking, ...).
    chat_template_kwargs: dict[str, Any] | None = None
