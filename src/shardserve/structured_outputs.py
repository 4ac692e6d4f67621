"""Structured outputs: what a request's text must match, in vLLM's shape (`StructuredOutputsParams`).

Exactly one kind per request: a JSON schema (`json`), any JSON object (`json_object`), a regular
expression (`regex`), a context-free grammar (`grammar`: GBNF/EBNF as llama.cpp, xgrammar and
SGLang write it, or Lark) or a list of strings (`choice`). Each kind becomes an llguidance grammar
(the engine vLLM calls `guidance`; xgrammar would pull a 1 GB triton wheel that a CPU engine never
uses), compiled and checked once per distinct spec and process, so a bad one is a ValueError
when the parameters are made. The sampling rank enforces it token by token (engine/grammar.py).
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from functools import lru_cache

KINDS = ("json", "json_object", "regex", "grammar", "choice")
# Compact JSON: flexible whitespace would let a model pad its output with blanks until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MAX_MESSAGE = 300
# So that a small model cannot run a structured output on to max_tokens (where it is no JSON at
# all), two defaults bound what a schema leaves open:
# - a number or integer without bounds of its own gets at most 18 digits before the point (every
#   such integer fits in 64 bits): at temperature 0 a model can repeat a digit forever; the
#   schema's own minimum or maximum replaces the bound;
# - a number without a multipleOf of its own gets at most 10 digits after the point (multipleOf
#   1e-10; llguidance takes no finer step), and so no exponent;
# - an object that lists `properties` and says nothing of others takes no others
#   (additionalProperties false), as xgrammar's strict mode, vLLM's default, reads such a schema:
#   a model can otherwise add properties forever; `"additionalProperties": true` (or a schema of
#   them, or patternProperties) keeps JSON Schema's own default.
INTEGER_BOUND = 10**18 - 1
FRACTION_DIGITS = 10
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_OPEN_OBJECT = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_LITERAL = ("enum", "const", "default", "examples")  # values, not schemas
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_COMBINED = ("allOf", "anyOf", "oneOf")


def bounded_schema(schema, closable: bool = True):
    """`schema` with those defaults (a copy: the caller's dict is left as it is). An object is
    closed only where closing it cannot narrow what it accepts: not as a branch of allOf, anyOf
    or oneOf (whose other branches may list other properties), not beside them, and not where
    `required` names a property it does not list."""
    if isinstance(schema, list):
        return [bounded_schema(s, closable) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _LITERAL:
            out[k] = v
        elif k in _NAMED and isinstance(v, dict):  # name -> schema: a property may be called "type"
            out[k] = {name: bounded_schema(sub) for name, sub in v.items()}
        else:
            out[k] = bounded_schema(v, closable=k not in _COMBINED)
    kinds = schema.get("type")
    kinds = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else set()
    if kinds & {"integer", "number"} and not any(b in schema for b in _BOUNDS):
        out.update(minimum=-INTEGER_BOUND, maximum=INTEGER_BOUND)
    if "number" in kinds and "multipleOf" not in schema:
        out["multipleOf"] = 10.0**-FRACTION_DIGITS
    listed = schema.get("properties")
    if (closable and isinstance(listed, dict) and not any(k in schema for k in _OPEN_OBJECT + _COMBINED)
            and set(schema.get("required") or ()) <= set(listed)):
        out["additionalProperties"] = False
    return out


@dataclass
class StructuredOutputsParams:
    """Set exactly one field. `json`: a JSON schema (a dict or its JSON text); `json_object`: True
    for any JSON object; `regex`; `grammar` (GBNF/EBNF, or Lark); `choice`: one of these strings.

    `thinking` (set by the server for a reasoning model, as vLLM applies structured outputs after
    the reasoning): "opened", the output begins inside a thinking section that runs free up to
    `</think>`; "optional", it may begin with a free `<think>...</think>`; the spec holds after it.
    `thinking_tokens`: the tags are tokens of their own (Qwen3's, R1's), which a grammar names as
    tokens, not text (the tokenizer worker sets it; see THINKING). `thinking_budget`: at most this
    many tokens of thinking, then `</think>` (tags as tokens only)."""

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    thinking: str | None = None
    thinking_tokens: bool = False
    thinking_budget: int | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"SamplingParams.structured_outputs must set exactly one of {', '.join(KINDS)} "
                             f"(got {', '.join(given) or 'none'})")
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"SamplingParams.structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError("SamplingParams.structured_outputs.json must be a JSON schema object")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("SamplingParams.structured_outputs.json_object must be True or None")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"SamplingParams.structured_outputs.{name} must be a non-empty string")
        choice = self.choice
        if choice is not None and not (isinstance(choice, list) and choice and all(isinstance(c, str) and c
                                                                                    for c in choice)):
            raise ValueError("SamplingParams.structured_outputs.choice must be a list of non-empty strings")
        if self.thinking not in (None, "opened", "optional"):  # the "-tokens" forms are the worker's to set
            raise ValueError("SamplingParams.structured_outputs.thinking must be None, 'opened' or 'optional'")
        budget = self.thinking_budget
        if budget is not None and not (self.thinking and isinstance(budget, int) and budget >= 1):
            raise ValueError("SamplingParams.structured_outputs.thinking_budget must be an integer >= 1, with "
                             "thinking")
        grammar_of(*self.key())  # compiles (cached) or raises

    def key(self) -> tuple[str, str, str | None]:
        """(kind, text, how thinking precedes it): what the compiled grammar depends on, as a cache key. A schema
        keeps its own key order: properties are generated in the order the schema lists them."""
        if self.json is not None:
            kind, text = "json", _json.dumps(bounded_schema(self.json))
        elif self.json_object:
            kind, text = "json", '{"type": "object"}'
        elif self.choice is not None:
            kind, text = "choice", _json.dumps(self.choice)
        else:
            kind, text = ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)
        thinking = f"{self.thinking}-tokens" if self.thinking_tokens else self.thinking
        if self.thinking_budget is not None:
            thinking += f"/{self.thinking_budget}"
        return kind, text, thinking

    def describe(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


# The thinking before the answer: where the tags are text, a lazy lexeme (it ends at the first
# `</think>`); where they are tokens (llguidance keeps added tokens out of text lexemes), by name.
THINKING = {None: None, "opened": 'start: thought @answer\nthought[lazy]: /(.|\\n)*<\\/think>/',
            "optional": 'start: thought? @answer\nthought[lazy]: /<think>(.|\\n)*<\\/think>/',
            "opened-tokens": 'start: thought @answer\nthought: text </think>\ntext{budget}: /(.|\\n)*/',
            "optional-tokens": 'start: thought? @answer\nthought: <think> text </think>\ntext{budget}: /(.|\\n)*/'}
ANY_TEXT = "(.|\n)*"  # the answer's spec where only the thinking is bounded


@lru_cache(maxsize=256)
def grammar_of(kind: str, text: str, thinking: str | None = None) -> str:
    """The llguidance grammar for one spec, checked (tokenizer-independent checks: syntax, schema
    features, references); ValueError with a one-line message when it cannot be compiled."""
    from llguidance import LLMatcher, grammar_from

    what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}[kind]
    try:
        if kind == "json":
            grammar = LLMatcher.grammar_from_json_schema(text, JSON_OPTIONS)
        elif kind == "choice":
            grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(_json.dumps(c) for c in _json.loads(text)))
        else:
            grammar = grammar_from(kind, text)
        if thinking is not None:
            form, _, budget = thinking.partition("/")
            grammar = _after_thinking(grammar, THINKING[form].replace("{budget}", f"[max_tokens={budget}]"
                                                                      if budget else ""))
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, TypeError, RuntimeError) as e:
        is_error, messages = True, [str(e)]
    if is_error:
        raise ValueError(f"SamplingParams.structured_outputs: invalid {what}: {one_line(messages[0])}")
    return grammar


def _after_thinking(grammar: str, lark: str) -> str:
    """`grammar` (one llguidance grammar: its JSON form, or Lark text) preceded by the thinking that
    `lark` allows."""
    try:
        inner = _json.loads(grammar)
    except ValueError:  # Lark text, as llguidance's lark and choice forms are
        inner = {"grammars": [{"lark_grammar": grammar}]}
    if len(inner["grammars"]) != 1:  # references between grammars would shift
        raise ValueError("a spec of several grammars cannot follow a model's thinking")
    inner["grammars"][0]["name"] = "answer"
    return _json.dumps({**inner, "grammars": [{"lark_grammar": lark}] + inner["grammars"]})


def one_line(message: str) -> str:
    text = " ".join(message.split())
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."
