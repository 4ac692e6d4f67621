"""Tools as OpenAI defines them: `tools`, `tool_choice` and `parallel_tool_calls` (chat completions;
the Responses and Messages APIs translate theirs into the same shape).

- The tool definitions go to the chat template (the model's own template decides how a model sees
  them), unless `tool_choice` is "none", which sends none.
- The output is read back with `--tool-call-parser` (tool_parsers.py), or the parser the chat
  template names (ToolFormat), into `tool_calls`, with finish_reason "tool_calls" (as vLLM:
  whenever the output holds a call); streamed, as argument deltas.
- "required" and a named function are enforced, not hoped for: a grammar in the parser's format
  (hermes where no parser is known) built from the functions' parameter schemas constrains the
  output token by token (structured outputs), so they need no flag. So is `strict: true` on a
  function under "auto": text, or calls that match their schemas.
- `parallel_tool_calls: false`: at most one call (the grammar's, or the first one parsed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from dataclasses import dataclass

from shardserve.sampling_params import SamplingParams
from shardserve.server.errors import APIError
from shardserve.server.reasoning import Reasoning
from shardserve.server.tool_parsers import PARSERS, get_parser
from shardserve.structured_outputs import StructuredOutputsParams

log = logging.getLogger(__name__)


@dataclass
class ToolUse:
    """What a chat request's tools mean for it; `parser` None: no tools in play, the output is content."""

    parser: type | None = None
    tools: list[dict] | None = None  # for the chat template
    grammar: str | None = None  # a Lark grammar for structured outputs
    parallel: bool = True
    why: tuple[str, str] = ("", "")  # (field, what) asks for the grammar
    reasoning: Reasoning = Reasoning()  # the thinking before the answer, split off first
    thinking_budget: int | None = None  # at most this many tokens of thinking (the Messages API's)

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """params with the tool-call grammar as their structured output; any structured output holds
        after the model's thinking."""
        return self.reasoning.constrain(self._with_grammar(params), self.thinking_budget)

    def _with_grammar(self, params: SamplingParams) -> SamplingParams:
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
        """The non-streaming answer's message (with `reasoning_content` where the model thought),
        and whether it calls tools."""
        reasoning, text = self.reasoning.parse(text)
        thought = {"reasoning_content": reasoning} if reasoning is not None else {}
        if self.parser is None:
            return {"role": "assistant", "content": text, **thought}, False
        with parser_faults(self.parser):
            content, calls = self.parser.parse(text)
        if not calls:
            return {"role": "assistant", "content": text, **thought}, False
        calls = calls if self.parallel else calls[:1]
        return {"role": "assistant", "content": content, "tool_calls": calls, **thought}, True

    def stream(self) -> ToolStream:
        return ToolStream(self)


@contextlib.contextmanager
def parser_faults(parser: type | None):
    """A parser that raises on one output fails that request with a 500 naming it, not the server."""
    try:
        yield
    except APIError:
        raise
    except Exception as e:
        name = getattr(parser, "__name__", "reasoning").lower()
        raise APIError(500, f"the {name} output parser failed on this output: "
                            f"{' '.join(str(e).split()) or type(e).__name__}") from None


def finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason is not None else reason


class ToolStream:
    """One choice's text deltas -> chat chunk deltas: reasoning_content, content, or tool-call deltas
    (the Responses and Messages APIs turn these into their own events)."""

    def __init__(self, use: ToolUse):
        self.p, self.parallel, self.called = (use.parser() if use.parser else None), use.parallel, False
        self.thinking = use.reasoning.stream()

    def deltas(self, text: str, finished: bool) -> list[dict]:
        out = []
        with parser_faults(type(self.p) if self.p is not None else None):
            for kind, part in self.thinking.feed(text, finished):
                out += [{"reasoning_content": part}] if kind == "reasoning" else self._answer(part, False)
            return out + (self._answer("", True) if finished else [])

    def _answer(self, text: str, finished: bool) -> list[dict]:
        if self.p is None:
            return [{"content": text}] if text else []
        out = self.p.feed(text) + (self.p.finish() if finished else [])
        if not self.parallel:
            out = [d for d in out if "content" in d or d["tool_calls"][0]["index"] == 0]
        self.called = self.called or any("tool_calls" in d for d in out)
        return out


@dataclass(frozen=True)
class ToolFormat:
    """How this server reads tool calls back: `--tool-call-parser`, else the format the model's chat
    template names (`<tool_call>` tags: hermes, Llama 3's `<|python_tag|>`: llama3_json), else none.
    `renders_tools`: whether the template shows the model tool definitions at all."""

    flag: str | None = None
    detected: str | None = None
    renders_tools: bool = True

    @classmethod
    def of(cls, flag: str | None, template: str, renders_tools: bool) -> ToolFormat:
        detected = next((name for marker, name in TEMPLATE_MARKERS if marker in template), None)
        fmt = cls(flag, detected, renders_tools)
        if flag is None:
            log.info("tool calls: %s", f"the chat template names the {detected} format, so --tool-call-parser "
                     f"{detected} is used" if detected else "no --tool-call-parser and the chat template names "
                     "no format: tool_choice 'required' and named functions use the hermes format (enforced by "
                     "grammar); 'auto' needs the flag")
        if not renders_tools:
            log.info("tool calls: the chat template does not render tool definitions: 'required' and named "
                     "functions are still enforced by grammar, but the model does not see the definitions")
        return fmt

    @property
    def parser(self) -> str | None:
        return self.flag or self.detected


# A chat template that writes these markers tells the model to call tools in that parser's format.
TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"))
GRAMMAR_FORMAT = "hermes"  # 'required' and named calls without a known format: the grammar imposes this one


def chat_tool_use(body, fmt: ToolFormat, reasoning: Reasoning = Reasoning()) -> ToolUse:
    """tool_use for a chat completions request."""
    choice = body.tool_choice
    named = None if choice is None or isinstance(choice, str) else {"name": choice.function.name}
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    return tool_use(tools, named or choice, body.parallel_tool_calls, fmt, reasoning)


def tool_use(tools: list[dict] | None, choice: str | dict | None, parallel: bool | None,
             fmt: ToolFormat, reasoning: Reasoning = Reasoning()) -> ToolUse:
    """Checks a request's tools (OpenAI's chat shape), tool choice ("none", "auto", "required" or
    {"name": function}) and parallel_tool_calls (400 naming the field at fault), and says what they
    ask for. Every API's tool fields come here in that shape; `reasoning`: the server's parser."""
    return dataclasses.replace(_tool_use(tools, choice, parallel, fmt), reasoning=reasoning)


def _tool_use(tools: list[dict] | None, choice: str | dict | None, parallel: bool | None,
              fmt: ToolFormat) -> ToolUse:
    tools = tools or []
    choice = choice if choice is not None else "auto" if tools else "none"
    named = choice["name"] if isinstance(choice, dict) else None
    if not tools:
        if choice in ("none", "auto"):
            return ToolUse()
        raise APIError(400, f"tool_choice {choice if named is None else named!r} needs tools", param="tool_choice")
    if choice == "none":  # as if no tools were offered
        return ToolUse()
    functions = [t["function"] for t in tools]
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise APIError(400, "tools must have distinct function names", param="tools")
    if named is not None and named not in names:
        raise APIError(400, f"tool_choice names the function {named!r}, which is not among the tools",
                       param="tool_choice")
    forced = named is not None or choice == "required"
    if fmt.parser is None and not forced:
        raise APIError(400, f"tool_choice 'auto' needs a tool-call parser, and neither this server nor its model's "
                            f"chat template names one: start it with --tool-call-parser {{{','.join(PARSERS)}}} "
                            f"(the one for the model's format), or ask for tool_choice 'required' or a named "
                            f"function, which a grammar enforces", param="tools")
    parser, parallel = get_parser(fmt.parser or GRAMMAR_FORMAT), parallel is not False
    grammar, why = None, ("", "")
    if named is not None:
        grammar, why = parser.grammar([functions[names.index(named)]], parallel=False), \
            ("tool_choice", f"tool_choice naming {named!r}")
    elif choice == "required":
        grammar, why = parser.grammar(functions, parallel=parallel), ("tool_choice", "tool_choice 'required'")
    elif any(f.get("strict") for f in functions):
        grammar, why = parser.grammar(functions, parallel=parallel, text=True), ("tools", "a strict function")
    # A template that cannot show the definitions would refuse them (ToolsIgnored): a forced call
    # needs none, its grammar carries the schemas.
    shown = tools if fmt.renders_tools or not forced else None
    return ToolUse(parser, shown, grammar, parallel and named is None, why)
