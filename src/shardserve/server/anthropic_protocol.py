"""Anthropic Messages API request bodies (pydantic), as the `anthropic` SDK (2.x) and raw HTTP send them.

Every field is honoured or refused with a 400 naming it, as on the OpenAI routes: unknown fields
are refused (extra="forbid"); known ones this server cannot honour are refused unless their
value asks for nothing (NOT_HONOURED). A block the model cannot read (documents, server tools'
results; images where the model reads none) is refused naming its type.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shardserve.server.protocol import STRICT, RefusedField, Refusing


class CacheControl(BaseModel):
    """A prompt-caching breakpoint. Honoured by the prefix cache, which keeps every prompt's pages
    (Anthropic's breakpoints mark what to cache; here all of it is, evicted least recently used
    rather than after the ttl)."""

    model_config = STRICT

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list | None = Field(None, max_length=0)  # citations come from documents, which are refused


class ToolUseBlock(BaseModel):
    model_config = STRICT

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: CacheControl | None = None


class ToolResultBlock(BaseModel):
    model_config = STRICT

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False  # the tool's answer reaches the model prefixed "Error: "
    cache_control: CacheControl | None = None


class ImageSource(BaseModel):
    """An image as Anthropic sends one: base64 data of a media type, or a URL (fetched as a chat's
    image_url is)."""

    model_config = STRICT

    type: Literal["base64", "url"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"] | None = None
    data: str | None = None
    url: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> ImageSource:
        needs = ("media_type", "data") if self.type == "base64" else ("url",)
        if missing := [k for k in needs if getattr(self, k) is None]:
            raise ValueError(f"a {self.type} image source needs {' and '.join(needs)}; {missing[0]} is missing")
        return self

    def as_url(self) -> str:
        """As a chat image part's URL: a data: URL, or the URL given."""
        return f"data:{self.media_type};base64,{self.data}" if self.type == "base64" else (self.url or "")


class ImageBlock(BaseModel):
    model_config = STRICT

    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None


class ThinkingBlock(BaseModel):
    """An earlier turn's thinking, sent back: the chat template reads it as reasoning_content
    (Qwen3's drops it from past turns, as the model was trained)."""

    model_config = STRICT

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


BLOCKS = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock, "thinking": ThinkingBlock,
          "image": ImageBlock}  # an image is refused later where the model reads none (anthropic_chat.py)
WHY_NOT = {"document": "this model reads text only",
           "search_result": "search results come from Anthropic's server tools",
           "redacted_thinking": "redacted thinking comes from Anthropic's models, encrypted",
           "server_tool_use": "server tools run on Anthropic's servers",
           "web_search_tool_result": "server tools run on Anthropic's servers",
           "container_upload": "this server runs no code containers"}


def _blocks(content: Any, where: str) -> Any:
    """Each block parsed by its type, or a 400 naming the block a model cannot read."""
    if not isinstance(content, list):
        return content
    out = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        kind = kind if isinstance(kind, str) else None
        if kind in BLOCKS:
            try:
                out.append(BLOCKS[kind].model_validate(block))
            except ValidationError as e:  # named from the message down, as every 400 is
                err = e.errors()[0]
                field = ".".join(str(p) for p in (where, i, *err["loc"]))
                raise RefusedField(field, f"invalid field {field!r}: {err['msg']}") from None
        else:
            why = WHY_NOT.get(kind, f"choose from {', '.join(BLOCKS)}")
            raise RefusedField(f"{where}.{i}", f"content block type {kind!r} is not supported: {why}")
    return out


class Message(BaseModel):
    model_config = STRICT

    role: Literal["user", "assistant"]
    content: str | list[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | ImageBlock]


class ToolDef(BaseModel):
    """A client tool: the model calls it, the client runs it."""

    model_config = STRICT

    name: str = Field(min_length=1)
    input_schema: dict
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None  # true: the input is held to the schema by grammar
    cache_control: CacheControl | None = None
    eager_input_streaming: bool | None = None  # input always streams as generated


class ToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(BaseModel):
    model_config = STRICT

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class JsonFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = STRICT

    format: JsonFormat | None = None
    effort: str | None = None  # refused: no model here trades effort for quality on request


class Metadata(BaseModel):
    model_config = STRICT

    user_id: str | None = None  # an end-user id for abuse monitoring: nothing to do with it here


SERVER_TOOL_PREFIXES = ("web_search", "web_fetch", "bash", "text_editor", "computer", "code_execution", "memory",
                        "tool_search", "mcp")


class MessagesRequest(Refusing):
    """POST /v1/messages. Sampling fields the SDK no longer sends (temperature, top_p, top_k) are
    still honoured for raw HTTP and older clients."""

    not_honoured: ClassVar[dict[str, tuple[tuple, str]]] = {
        "service_tier": (("auto", "standard_only"), "this server has one service tier"),
        "container": ((), "this server runs no code containers"),
        "inference_geo": ((), "this server runs where it runs"),
        "speed": (("standard",), "this server has one speed"),
        "diagnostics": ((), "diagnostics are Anthropic's"),
        "user_profile_id": ((), "user profiles are Anthropic's"),
        "workspace_id": ((), "workspaces are Anthropic's"),
        "mcp_servers": ((), "this server connects to no MCP servers"),
    }

    @model_validator(mode="before")
    @classmethod
    def _content_blocks(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("messages"), list):
            data["messages"] = [
                {**m, "content": _blocks(m.get("content"), f"messages.{i}.content")} if isinstance(m, dict) else m
                for i, m in enumerate(data["messages"])]
        tools = data.get("tools")
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                server = isinstance(kind, str) and kind.startswith(SERVER_TOOL_PREFIXES)
                why = "server tools run on Anthropic's servers" if server else "only custom (client) tools are"
                raise RefusedField(f"tools.{i}", f"tool type {kind!r} is not supported: {why}")
        return data

    model: str  # required, as Anthropic requires it
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None
    # vLLM's: variables for the chat template (enable_thinking, ...).
    chat_template_kwargs: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages body without max_tokens or what only shapes the
    answer (which counting the prompt would ignore)."""

    not_honoured: ClassVar[dict[str, tuple[tuple, str]]] = {
        **MessagesRequest.not_honoured,
        "stream": ((False,), "counting tokens makes no answer to stream"),
        **{name: ((), "it shapes the answer, and counting tokens makes none") for name in (
            "temperature", "top_p", "top_k", "stop_sequences", "metadata")},
    }

    max_tokens: int | None = Field(None, ge=1)
