"""Incremental detokenization: a sequence's text grown by a few tokens at a time.

Decoding a whole output on every step costs O(length) per step, which a long generation cannot
afford. Like vLLM and TGI, decode only a short window: the tokens since the last boundary
(`prefix_offset`) with and without the newest ones, and append the difference. Text that ends in
U+FFFD (an incomplete UTF-8 sequence) is held back until a later token completes it, but for at
most MAX_HOLD tokens: no UTF-8 character spans more than 4 bytes, so text still ending in U+FFFD
after that is really invalid (a model can emit any bytes) and is taken as it is; holding it for
good would stall the text and let the decode window grow with the output. The detokenizer (streaming) and the engine
(stop strings) both use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

Decode = Callable[[list[int], bool], str]
MAX_HOLD = 4


@dataclass
class IncrementalText:
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # the text of ids[:read_offset]

    def add(self, new_ids: list[int], decode: Decode, skip_special_tokens: bool) -> int:
        """Append `new_ids`; returns how many characters the text grew by."""
        self.ids.extend(new_ids)
        before = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens)
        after = decode(self.ids[self.prefix_offset :], skip_special_tokens)
        pending = len(self.ids) - self.read_offset
        if len(after) > len(before) and (not after.endswith("\ufffd") or pending > MAX_HOLD):
            self.text += after[len(before) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return len(after) - len(before)
        return 0


def find_stop(text: str, grew: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the last `grew` characters of `text` (earlier
    ones were looked for when they arrived): (index where it starts, the string), or None."""
    hits = []
    for s in stops:
        i = text.find(s, max(0, len(text) - grew - len(s) + 1))
        if i >= 0:
            hits.append((i, s))
    return min(hits) if hits else None
