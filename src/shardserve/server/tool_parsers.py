"""Tool-call parsers (`--tool-call-parser`): a model's text -> OpenAI `tool_calls`, whole or streamed.

hermes (Hermes, Qwen): text, then `<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>`, one or more.
llama3_json (Llama 3.x): the whole output is `{"name": .., "parameters": {..}}` (or "arguments"), maybe after
`<|python_tag|>`, several separated by `;`.

`get_parser(name).parse(text)` -> (content or None, calls); `get_parser(name)()` is a stream parser whose
`feed(delta)` and `finish()` return chunk deltas as vLLM and SGLang send them: `{"content"}`; per call
`{"tool_calls": [{index, id, type, function: {name, arguments: ""}}]}`, then `{"tool_calls": [{index,
function: {arguments}}]}` as the arguments are generated. `grammar(...)` enforces the format (server/tools.py).
`arguments` is the raw JSON text of the arguments object as the model wrote it, so the deltas add up to the
whole parse's string. Text that may yet become a tag is held back; whitespace touching a call is dropped; a
block that is not a well-formed call stays content. One divergence: a call whose JSON breaks only after its
arguments began to stream stays a (broken) call in the stream, content in the whole parse. Each call's JSON is
scanned by tool_call_scanner.py.
"""

from __future__ import annotations

import json

from shardserve.server.tool_call_scanner import CallStream
from shardserve.structured_outputs import JSON_OPTIONS, bounded_schema


def _content(out: list, text: str) -> None:
    if text:
        out.append({"content": text})


class _Stream:
    """A stream parser: `feed(delta)` and, at the end of the output, `finish()` return chunk deltas. Not
    `eager`, a call goes out only once complete and well-formed: `parse` is that over the whole text."""

    def __init__(self, eager: bool = True):
        self.buf, self.after, self.n, self.call, self.seen, self.eager = "", False, 0, None, "", eager

    @classmethod
    def parse(cls, text: str) -> tuple[str | None, list[dict]]:
        """-> (content or None, [{id, type, function: {name, arguments}}])."""
        content, calls = "", []
        for d in cls(eager=False).feed(text, final=True):
            if "content" in d:
                content += d["content"]
            elif "id" in (tc := d["tool_calls"][0]):
                calls.append({"id": tc["id"], "type": "function", "function": dict(tc["function"])})
            else:
                calls[-1]["function"]["arguments"] += tc["function"]["arguments"]
        return content or None, calls

    def feed(self, delta: str, final: bool = False) -> list[dict]:
        out: list[dict] = []
        self.buf, self.seen = self.buf + delta, self.seen + delta
        self._run(out, final)
        return out

    def finish(self) -> list[dict]:
        return self.feed("", final=True)

    @classmethod
    def grammar(cls, functions: list[dict], parallel: bool = True, text: bool = False) -> str:
        """A Lark grammar (llguidance's, JSON schemas inlined with %json) that only calls of these functions
        ({name, parameters} each) in this parser's format match: one, or with `parallel` one or more; with
        `text`, plain text instead (hermes: text before the calls), as tool_choice auto allows. The
        parameter schemas get structured outputs' bounds (structured_outputs.bounded_schema)."""
        fns = [{"type": "object", "required": ["name", cls.args], "additionalProperties": False,
                "properties": {"name": {"const": f["name"]},
                               cls.args: bounded_schema(f.get("parameters") or {"type": "object"})}}
               for f in functions]
        schema = json.dumps({"x-guidance": JSON_OPTIONS, "anyOf": fns})
        more = f" ({json.dumps(cls.sep)} call)*" if parallel else ""
        start = (cls.text_start if text else "call{more}").replace("{more}", more)
        return f"start: {start}\ncall: {cls.call_rule}\nfn: %json {schema}\n"

    def _feed_call(self, out: list, final: bool) -> str:
        rest, self.buf = self.call.stream(self.buf, out, final), ""
        self.n += self.call.state == "done"
        return rest

    def _lstrip_after_call(self) -> bool:
        """Drops whitespace that follows a call; False while nothing else has come."""
        if self.after:
            self.buf = self.buf.lstrip()
            self.after = not self.buf
        return not self.after


HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


class Hermes(_Stream):
    mode, args, sep, call_rule = "text", "arguments", "\n", '"<tool_call>\\n" fn "\\n</tool_call>"'
    # Lazy text up to the first tag (its suffix), or text without a tag.
    text_start = ('TEXT | pre fn "\\n</tool_call>"{more}\npre[suffix="<tool_call>\\n"]: /(?s:.*)/\n'
                  'TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/')

    def _run(self, out: list, final: bool) -> None:
        while True:
            if self.mode == "call":
                rest = self._feed_call(out, final)
                if self.call.state == "open":
                    return
                if self.call.state == "failed":  # not a call: the tag is content, look again after it
                    _content(out, self.pre + HERMES_START)
                    self.buf, self.mode = self.call.text + rest, "text"
                else:
                    self.buf, self.mode = rest, "close"
            elif self.mode == "close":
                s = self.buf.lstrip()
                if HERMES_END.startswith(s) and s != HERMES_END and not final:
                    return
                self.buf, self.mode, self.after = s.removeprefix(HERMES_END), "text", True
            elif not self._lstrip_after_call():
                return
            elif (i := self.buf.find(HERMES_START)) >= 0:
                body = self.buf[:i].rstrip()
                _content(out, body)
                self.pre, self.buf = self.buf[len(body):i], self.buf[i + len(HERMES_START):]
                self.mode, self.call = "call", CallStream(self.n, self.eager)
            else:  # hold back what may be the start of a tag, and whitespace that may precede one
                keep = 0 if final else next((k for k in range(len(HERMES_START) - 1, 0, -1)
                                             if self.buf.endswith(HERMES_START[:k])), 0)
                body = self.buf[:len(self.buf) - keep]
                body = body if final else body.rstrip()
                _content(out, body)
                self.buf = self.buf[len(body):]
                return


PYTHON_TAG = "<|python_tag|>"


class Llama3Json(_Stream):
    mode, args, sep, call_rule = "detect", "parameters", "; ", "fn"
    text_start = "TEXT | call{more}\nTEXT: /(?s:.*)/ & ~/(?s:\\s*[{].*)/ & ~/(?s:\\s*<\\|python_tag\\|>.*)/"

    def _run(self, out: list, final: bool) -> None:
        while True:
            s = self.buf.lstrip()
            if self.mode == "detect":
                if not final and (not s or PYTHON_TAG.startswith(s) and s != PYTHON_TAG):
                    return
                if s.startswith(PYTHON_TAG) or s.startswith("{"):
                    self.buf, self.mode, self.call = s.removeprefix(PYTHON_TAG), "call", CallStream(0, self.eager)
                else:
                    self.mode = "text"
            elif self.mode == "call":
                rest = self._feed_call(out, final)
                if self.call.state == "open":
                    return
                if self.call.state == "failed" and self.n == 0:  # no call at all: everything is content
                    _content(out, self.seen)
                    self.buf, self.mode = "", "text"
                elif self.call.state == "failed":  # the rest is content
                    self.buf, self.mode, self.after = self.call.text + rest, "text", True
                else:
                    self.buf, self.mode = rest, "sep"
            elif self.mode == "sep":
                if not s and not final:
                    return
                if s.startswith(";"):
                    self.buf, self.mode, self.call = s[1:], "call", CallStream(self.n, self.eager)
                else:
                    self.buf, self.mode = s, "text"
            else:
                if self._lstrip_after_call():
                    _content(out, self.buf)
                    self.buf = ""
                return


PARSERS = {"hermes": Hermes, "llama3_json": Llama3Json}


def get_parser(name: str) -> type[_Stream]:
    """The parser class: `.parse(text)` parses a whole output, an instance parses a stream."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(PARSERS)}")
    return PARSERS[name]
