"""Token ids -> streamed text, one request at a time, safe for multi-byte characters.

Each step decodes only a short window (`text.IncrementalText`), as vLLM does, and withholds text
while it ends in U+FFFD (an incomplete UTF-8 sequence) or while a stop string could still be
forming (`hold` characters). At the end the text is the full decode, cut at the
stop string if one matched, so streamed pieces always add up to the final text.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from shardserve.ipc.messages.api import TextOut, TokenOut
from shardserve.text import IncrementalText

DROPPED_KEPT = 10000  # dropped stream ids remembered


@dataclass
class _Stream:
    inc: IncrementalText = field(default_factory=IncrementalText)
    sent: int = 0  # characters of the text already sent


class Detokenizer:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.streams: dict[str, _Stream] = {}
        # Streams of a dead replica, dropped: its last token batches can still be on the way and
        # must not start them again (the oldest are forgotten first).
        self.dropped: OrderedDict[str, None] = OrderedDict()

    def feed_safely(self, out: TokenOut) -> TextOut:
        """feed, or where decoding this request raised, a TextOut carrying why (the API fails that
        request and aborts it; the batch's others go on)."""
        try:
            return self.feed(out)
        except Exception as e:
            self.streams.pop(out.rid, None)
            why = f"detokenizing this request's output failed: {' '.join(str(e).split()) or type(e).__name__}"
            return TextOut(rid=out.rid, text="", new_ids=[], finished=False, error=why)

    def _decode(self, ids: list[int], skip: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip) if self.tok is not None else ""

    def feed(self, out: TokenOut) -> TextOut:
        s = self.streams.setdefault(out.rid, _Stream())
        skip = out.skip_special_tokens
        s.inc.add(out.new_ids, self._decode, skip)
        text = s.inc.text
        if out.finished:
            del self.streams[out.rid]
            final = self._decode(s.inc.ids, skip)
            if out.text_cut is not None:
                final = final[: out.text_cut]
            delta = final[s.sent :] if final.startswith(text[: s.sent]) else ""
        else:
            upto = max(s.sent, len(text) - out.hold)
            delta, s.sent = text[s.sent : upto], upto
        return TextOut(
            rid=out.rid, text=delta, new_ids=out.new_ids, finished=out.finished, finish_reason=out.finish_reason,
            stop_reason=out.stop_reason, logprobs=self._name_tokens(out.logprobs, skip),
            prompt_logprobs=self._name_tokens(out.prompt_logprobs, skip),
            prompt_tokens=out.prompt_tokens,
            completion_tokens=len(s.inc.ids), cached_tokens=out.cached_tokens, embedding=out.embedding,
            error=out.error,
        )

    def _name_tokens(self, logprobs: list[dict] | None, skip: bool) -> list[dict] | None:
        """Add each token's text, which the OpenAI logprobs format reports beside its id."""
        if not logprobs:
            return logprobs
        for lp in logprobs:
            lp["token"] = self._decode([lp["token_id"]], False)
            lp["top_logprobs"] = [[i, v, self._decode([i], False)] for i, v, *_ in lp["top_logprobs"]]
        return logprobs

    def drop(self, rid: str) -> None:
        self.streams.pop(rid, None)
        self.dropped[rid] = None
        while len(self.dropped) > DROPPED_KEPT:
            self.dropped.popitem(last=False)

    def live(self, out: TokenOut) -> bool:
        """Whether `out` belongs to a stream that was not dropped."""
        return out.rid not in self.dropped
