"""Reasoning parsers (`--reasoning-parser`): a thinking model's text -> (reasoning, content).

Qwen3 and DeepSeek-R1 think between `<think>` and `</think>` before they answer. The text
between goes to `reasoning_content` (chat completions), `reasoning` items (responses) or
`thinking` blocks (messages); what follows `</think>` is the answer, which the tool-call parser
then reads.

Where thinking begins is decided once per request, as vLLM's parsers do:
- `deepseek_r1`: the output begins inside the thinking (R1's template opens `<think>` in the
  prompt; an opening tag the model writes anyway is dropped); no `</think>`: all reasoning.
- `qwen3`: the output begins inside the thinking where the model's chat template opens the tag
  itself (Qwen3-Thinking-2507; `opened`, probed once at start with the template's default
  variables), or where the output begins with `<think>` (hybrid Qwen3, which writes it); else
  all of it is the answer (`enable_thinking: false` closes the thinking in the prompt).

Whole and streamed text split alike: `parse` runs the same stream over the whole text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardserve.sampling_params import SamplingParams
from shardserve.structured_outputs import ANY_TEXT, StructuredOutputsParams

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True)
class Reasoning:
    """The server's reasoning parser: `name` (None: no parser, all text is content), and whether the
    chat template opens the thinking in the prompt."""

    name: str | None = None
    template_opens: bool = False

    def __post_init__(self) -> None:
        if self.name is not None and self.name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {self.name!r}; choose from {', '.join(PARSERS)}")

    @classmethod
    def of(cls, name: str | None, prompt_end: str) -> Reasoning:
        """`prompt_end`: how the template's generation prompt ends (chat_messages.template_facts)."""
        return cls(name, prompt_end.rstrip().endswith(START))

    @property
    def opened(self) -> bool:
        """Whether the output begins inside the thinking."""
        return self.name == "deepseek_r1" or (self.name == "qwen3" and self.template_opens)

    def constrain(self, params: SamplingParams, budget: int | None = None) -> SamplingParams:
        """params whose structured output (if any) holds after the thinking, not over it; `budget`:
        at most that many tokens of thinking (a grammar then holds the whole output)."""
        spec = params.structured_outputs
        if self.name is None or (spec is None and budget is None):
            return params
        spec = spec if spec is not None else StructuredOutputsParams(regex=ANY_TEXT)
        thinking = dataclasses.replace(spec, thinking="opened" if self.opened else "optional",
                                       thinking_budget=budget)
        return dataclasses.replace(params, structured_outputs=thinking)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.name is not None, self.opened)

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning, or None where the output has none, as a stream sends none; the answer)."""
        parts = self.stream().feed(text, final=True)
        reasoning = "".join(t for kind, t in parts if kind == "reasoning")
        return (reasoning or None), "".join(t for kind, t in parts if kind == "content")


class ReasoningStream:
    """Text deltas -> [(kind, text)], kind "reasoning" or "content". Text that may yet be a tag is
    held back (never more than a tag's length); whitespace between `</think>` and the answer is
    dropped."""

    def __init__(self, active: bool, opened: bool):
        self.state = "content" if not active else "start"
        self.opened = opened
        self.thought = False  # whether any of the output was thinking
        self.held = ""

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        self.held += text
        out: list[tuple[str, str]] = []
        while True:
            before = (self.state, self.held)
            self._step(out, final)
            if (self.state, self.held) == before:
                return [(k, t) for k, t in out if t]

    def _step(self, out: list, final: bool) -> None:
        if self.state == "start":
            head = self.held.lstrip()
            if head.startswith(START):
                self.state, self.held, self.thought = "reasoning", head[len(START):], True
            elif START.startswith(head) and not final:
                return  # may still become the opening tag
            else:
                self.state = "reasoning" if self.opened else "content"
                self.thought = self.opened
        elif self.state == "reasoning":
            at = self.held.find(END)
            if at >= 0:
                out.append(("reasoning", self.held[:at]))
                self.state, self.held = "after", self.held[at + len(END):]
                return
            keep = 0 if final else _partial_tag(self.held, END)
            out.append(("reasoning", self.held[:len(self.held) - keep]))
            self.held = self.held[len(self.held) - keep:]
        elif self.state == "after":  # the answer starts at its first non-blank character
            stripped = self.held.lstrip()
            if stripped or final:
                self.state, self.held = "content", stripped
        else:
            out.append(("content", self.held))
            self.held = ""


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
