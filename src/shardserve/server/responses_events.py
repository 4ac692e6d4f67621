"""Chat deltas (tools.ToolStream) -> Responses stream events, one output item open at a time.

A reasoning item carries one reasoning_text part, a message one output_text part; a function call
streams its arguments. Each item is announced (output_item.added, content_part.added), filled
(…delta), and closed (…done, content_part.done, output_item.done) with the same id it was
announced with; `done` collects the closed items for the final Response."""

from __future__ import annotations

from shardserve.server.responses_chat import call_item, message_item, new_id, reasoning_item


class Items:
    def __init__(self):
        self.started = False
        self.done: list[dict] = []  # closed items, in output order
        self.kind: str | None = None  # the open item's type
        self.item_id, self.text, self.call = "", "", {}  # the open item's id, its text or arguments, its call

    @property
    def index(self) -> int:
        return len(self.done)

    def feed(self, delta: dict) -> list[dict]:
        if "reasoning_content" in delta:
            return self._ensure("reasoning") + self._text("response.reasoning_text.delta", delta["reasoning_content"])
        if "content" in delta:
            return self._ensure("message") + self._text("response.output_text.delta", delta["content"])
        (call,) = delta["tool_calls"]
        out = []
        if call.get("id") is not None:  # a new call begins
            out = self.close()
            self.kind, self.item_id, self.text = "function_call", new_id("fc"), ""
            self.call = {"call_id": call["id"], "name": call["function"]["name"]}
            out.append(self._added(call_item(self.item_id, self.call["call_id"], self.call["name"], "",
                                             "in_progress")))
        args = call["function"].get("arguments") or ""
        if args:
            self.text += args
            out.append({"type": "response.function_call_arguments.delta", "item_id": self.item_id,
                        "output_index": self.index, "delta": args})
        return out

    def _ensure(self, kind: str) -> list[dict]:
        if self.kind == kind:
            return []
        out = self.close()
        self.kind, self.item_id, self.text = kind, new_id("rs" if kind == "reasoning" else "msg"), ""
        item = reasoning_item(self.item_id, "", "in_progress") if kind == "reasoning" else \
            message_item(self.item_id, None, status="in_progress")
        return out + [self._added(item), self._part("response.content_part.added", "")]

    def _added(self, item: dict) -> dict:
        return {"type": "response.output_item.added", "output_index": self.index, "item": item}

    def _part(self, kind: str, text: str) -> dict:
        part = {"type": "reasoning_text", "text": text} if self.kind == "reasoning" else \
            {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": kind, "item_id": self.item_id, "output_index": self.index, "content_index": 0, "part": part}

    def _text(self, kind: str, text: str) -> list[dict]:
        self.text += text
        extra = {"logprobs": []} if kind == "response.output_text.delta" else {}
        return [{"type": kind, "item_id": self.item_id, "output_index": self.index, "content_index": 0,
                 "delta": text, **extra}]

    def close(self, complete: bool = True) -> list[dict]:
        """Events that close the open item (none if none is open)."""
        if self.kind is None:
            return []
        where = {"item_id": self.item_id, "output_index": self.index}
        status = "completed" if complete else "incomplete"
        if self.kind == "function_call":
            item = call_item(self.item_id, self.call["call_id"], self.call["name"], self.text, status)
            out = [{"type": "response.function_call_arguments.done", **where, "arguments": self.text,
                    "name": self.call["name"]}]
        elif self.kind == "reasoning":
            item = {**reasoning_item(self.item_id, self.text), "status": status}
            out = [{"type": "response.reasoning_text.done", **where, "content_index": 0, "text": self.text},
                   self._part("response.content_part.done", self.text)]
        else:
            item = message_item(self.item_id, self.text, complete)
            out = [{"type": "response.output_text.done", **where, "content_index": 0, "text": self.text,
                    "logprobs": []}, self._part("response.content_part.done", self.text)]
        out.append({"type": "response.output_item.done", "output_index": self.index, "item": item})
        self.done.append(item)
        self.kind = None
        return out
