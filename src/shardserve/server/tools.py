"""Tools on chat completions: `tools`, `tool_choice` and `parallel_tool_calls` as OpenAI defines them.

- The tool definitions go to the chat template (the model's own template decides how a model sees
  them), unless `tool_choice` is "none", which sends none.
- The output is read back with the server's `--tool-call-parser` (tool_parsers.py) into
  `tool_calls`, with finish_reason "tool_calls" (as vLLM: whenever the output holds a call);
  streamed, as argument deltas.
- "required" and a named function are enforced, not hoped for: a grammar in the parser's format
  built from the functions' parameter schemas constrains the output token by token (structured
  outputs). So is `strict: true` on a function under "auto": text, or calls that match their schemas.
- `parallel_tool_calls: false`: at most one call (the grammar's, or the first one parsed).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from shardserve.core import SamplingParams
from shardserve.server.errors import APIError
from shardserve.server.tool_parsers import PARSERS, get_parser
from shardserve.structured_outputs import StructuredOutputsParams


@dataclass
class ToolUse:
    """What a chat request's tools mean for it; `parser` None: no tools in play, the output is content."""

    parser: type | None = None
    tools: list[dict] | None = None  # for the chat template
    grammar: str | None = None  # a Lark grammar for structured outputs
    parallel: bool = True
    why: tuple[str, str] = ("", "")  # (field, what) asks for the grammar

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """params with the tool-call grammar as their structured output."""
        if self.grammar is None:
            return params
        field, what = self.why
        if params.structured_outputs is not None:
            raise APIError(400, f"{what} constrains the output to tool calls, so it cannot be combined with "
                                f"response_format or another structured output", param=field)
        try:
            spec = StructuredOutputsParams(grammar=self.grammar)
        except ValueError as e:
            why = re.sub(r"^SamplingParams\.structured_outputs[.:]\s*", "", str(e))
            raise APIError(400, f"{what} needs the tools' parameter schemas enforced, and they cannot be: {why}",
                           param="tools") from None
        return dataclasses.replace(params, structured_outputs=spec)

    def message(self, text: str) -> tuple[dict, bool]:
        """The non-streaming answer's message, and whether it calls tools."""
        if self.parser is None:
            return {"role": "assistant", "content": text}, False
        content, calls = self.parser.parse(text)
        if not calls:
            return {"role": "assistant", "content": text}, False
        return {"role": "assistant", "content": content, "tool_calls": calls if self.parallel else calls[:1]}, True

    def stream(self) -> ToolStream:
        return ToolStream(self)


def finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason is not None else reason


class ToolStream:
    """One choice's text deltas -> chat chunk deltas (content, or tool-call deltas)."""

    def __init__(self, use: ToolUse):
        self.p, self.parallel, self.called = (use.parser() if use.parser else None), use.parallel, False

    def deltas(self, text: str, finished: bool) -> list[dict]:
        if self.p is None:
            return [{"content": text}] if text else []
        out = self.p.feed(text) + (self.p.finish() if finished else [])
        if not self.parallel:
            out = [d for d in out if "content" in d or d["tool_calls"][0]["index"] == 0]
        self.called = self.called or any("tool_calls" in d for d in out)
        return out


def tool_use(body, parser_name: str | None) -> ToolUse:
    """Checks the request's tool fields (400 naming the field at fault) and says what they ask for."""
    tools, choice = body.tools or [], body.tool_choice
    choice = choice if choice is not None else "auto" if tools else "none"
    named = None if isinstance(choice, str) else choice.function.name
    if not tools:
        if choice in ("none", "auto"):
            return ToolUse()
        raise APIError(400, f"tool_choice {choice if named is None else named!r} needs tools", param="tool_choice")
    if choice == "none":  # as if no tools were offered
        return ToolUse()
    if parser_name is None:
        raise APIError(400, f"tools need a tool-call parser, and this server has none: start it with "
                            f"--tool-call-parser {{{','.join(PARSERS)}}} (the one for the model's format)",
                       param="tools")
    functions = [t.function.model_dump(exclude_none=True) for t in tools]
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise APIError(400, "tools must have distinct function names", param="tools")
    if named is not None and named not in names:
        raise APIError(400, f"tool_choice names the function {named!r}, which is not among the tools",
                       param="tool_choice")
    parser, parallel = get_parser(parser_name), body.parallel_tool_calls is not False
    grammar, why = None, ("", "")
    if named is not None:
        grammar, why = parser.grammar([functions[names.index(named)]], parallel=False), \
            ("tool_choice", f"tool_choice naming {named!r}")
    elif choice == "required":
        grammar, why = parser.grammar(functions, parallel=parallel), ("tool_choice", "tool_choice 'required'")
    elif any(f.get("strict") for f in functions):
        grammar, why = parser.grammar(functions, parallel=parallel, text=True), ("tools", "a strict function")
    return ToolUse(parser, [t.model_dump(exclude_none=True) for t in tools], grammar, parallel and named is None,
                   why)
