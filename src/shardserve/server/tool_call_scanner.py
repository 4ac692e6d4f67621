"""One tool call's JSON, scanned as it streams: `_Scanner` walks a JSON object char by char,
resumably (the raw spans of its top-level values, where it ends, whether it went wrong), and
`CallStream` turns it into OpenAI's tool-call deltas (the header once the name is known, then the
arguments' text as it comes). The parsers of tool_parsers.py run one per call.
"""

from __future__ import annotations

import json
import uuid

ARG_KEYS = ("arguments", "parameters")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _Scanner:
    """Walks one JSON object char by char, resumably: the raw spans of its top-level values (first occurrence
    of each key), where the object ends, and whether it has gone wrong. Any split of the input into pieces
    leaves it in the same state."""

    def __init__(self):
        self.text, self.pos, self.depth, self.stage = "", 0, 0, "start"
        self.in_str = self.esc = self.bad = False
        self.key, self.key_start, self.end = None, 0, None
        self.spans: dict[str, list] = {}  # key -> [start, end or None while open]
        self.cur: list | None = None  # the span being filled (None for a repeated key)

    def _close(self, i: int) -> None:
        self.stage = "after"
        if self.cur is not None:
            self.cur[1] = i

    def feed(self, s: str) -> str:
        """Consumes s up to the object's end or the first char that breaks it; returns what is left."""
        self.text += s
        while self.pos < len(self.text) and self.end is None and not self.bad:
            i, c = self.pos, self.text[self.pos]
            self.pos += 1
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
                    if self.depth == 1 and self.stage == "key":
                        try:
                            self.key, self.stage = json.loads(self.text[self.key_start:i + 1]), "colon"
                        except ValueError:  # a bad escape
                            self.bad = True
                    elif self.depth == 1:
                        self._close(i + 1)
            elif c in " \t\r\n":
                if self.depth == 1 and self.stage == "scalar":
                    self._close(i)
            elif self.depth == 0:
                self.depth, self.stage, self.bad = 1, "key", c != "{"
            elif self.depth > 1:
                self.in_str = c == '"'
                self.depth += (c in "{[") - (c in "}]")
                if self.depth == 1:
                    self._close(i + 1)
            elif self.stage == "key":
                if c == '"':
                    self.in_str, self.key_start = True, i
                elif c == "}" and not self.spans:
                    self.end = i + 1
                else:
                    self.bad = True
            elif self.stage == "colon":
                self.stage, self.bad = "value", c != ":"
            elif self.stage == "value":
                self.cur = None if self.key in self.spans else self.spans.setdefault(self.key, [i, None])
                self.in_str = c == '"'
                self.depth, self.stage = (2, "nested") if c in "{[" else (1, "string" if c == '"' else "scalar")
            elif c in ",}" and self.stage in ("scalar", "after"):
                if self.stage == "scalar":
                    self._close(i)
                self.stage = "key"
                if c == "}":
                    self.end = i + 1
            else:
                self.bad = self.stage == "after"
        rest, self.text = self.text[self.pos:], self.text[:self.pos]
        return rest

    def raw(self, key: str | None) -> str | None:
        """Key's value as written so far; None before it starts."""
        span = self.spans.get(key)
        return None if span is None else self.text[span[0]:span[1]]

    def name(self) -> str | bool | None:
        """The name once its string is complete; False if it cannot be a name; None while unknown."""
        span = self.spans.get("name")
        if span is None or span[1] is None and self.text[span[0]] == '"':
            return None
        try:
            name = json.loads(self.raw("name"))
        except ValueError:
            return False
        return name if isinstance(name, str) and name else False

    def args_key(self) -> str | None:
        return next((k for k in self.spans if k in ARG_KEYS), None)

    def call(self) -> tuple[str, str] | None:
        """(name, arguments) of the finished object; None if it is not a well-formed call."""
        key = self.args_key()
        try:
            json.loads(self.text[:self.end] if self.end and not self.bad else "")
            args = json.loads(self.raw(key)) if key else {}
            if isinstance(args, str) and isinstance(json.loads(args), dict):  # arguments as a JSON string
                return (self.name(), args) if self.name() else None
        except ValueError:
            return None
        return (self.name(), self.raw(key) if key else "{}") if self.name() and isinstance(args, dict) else None


class CallStream(_Scanner):
    """Streams one call: the header once the name is known and an arguments object has begun, then the
    arguments' text as it comes. state: "open", "done" (ended: well-formed, or already begun) or "failed"
    (not a call, nothing sent)."""

    def __init__(self, index: int, eager: bool):
        super().__init__()
        self.index, self.eager, self.sent, self.state = index, eager, None, "open"

    def _send(self, out: list, args: str, name: str | None = None) -> None:
        if name is not None:
            out.append({"tool_calls": [{"index": self.index, "id": new_call_id(), "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})
            self.sent = ""
        if args[len(self.sent):]:
            out.append({"tool_calls": [{"index": self.index, "function": {"arguments": args[len(self.sent):]}}]})
        self.sent = args

    def stream(self, s: str, out: list, final: bool = False) -> str:
        rest = self.feed(s)
        name, key = self.name(), self.args_key()
        if self.sent is not None or self.eager and name and key and self.raw(key).startswith("{"):
            self._send(out, self.raw(key), None if self.sent is not None else name)
        if self.end is not None or self.bad or name is False or final:
            call = self.call()
            if call is None and self.sent is None:
                self.state = "failed"
                return rest
            if call is not None and call[1].startswith(self.sent or ""):
                self._send(out, call[1], call[0] if self.sent is None else None)
            self.state = "done"
        return rest
