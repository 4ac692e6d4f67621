"""Structured outputs on the sampling rank: a grammar matcher per request, its next-token mask
applied to the request's logits row before sampling, and the sampled token fed back after.

Only the sampling rank (the last pipeline stage's tensor-rank-0, context-rank-0 process) holds
matchers: it keeps each request's `Request` for the request's whole life (stage_worker.py), so
the matcher lives on it. Preemption frees a request's KV pages and recomputes them later, but a
token is sampled once and never again, so the matcher, which has consumed exactly the sampled
tokens, stays valid across preemptions. Each of a prompt's n samples is its own request with its
own matcher. Log-probabilities are taken before the mask (the model's raw distribution).

The grammar engine is llguidance (see shardserve/structured_outputs.py for why): its tokenizer
view is built from the model's Hugging Face tokenizer on the first constrained request (about a
second for a 50k vocabulary), and each distinct spec is compiled once per process into a
template matcher that every request using it deep-copies (microseconds).

End of output: the request's EOS tokens are allowed only where the grammar is complete (and the
request does not ignore EOS); once the grammar can take nothing more, or EOS is sampled, the
request ends with finish_reason "stop" (`accept` reports it; the leader ends it).
"""

from __future__ import annotations

import ctypes
import logging
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from shardserve.core import Request
from shardserve.loader.model_path import Checkpoint
from shardserve.loader.tokenizer import load_tokenizer
from shardserve.structured_outputs import StructuredOutputsParams, grammar_of, one_line

log = logging.getLogger(__name__)
TEMPLATES = 64  # compiled specs kept per process, least recently used dropped first


class Guide:
    """The sampling rank's grammar state: llguidance's tokenizer, compiled specs, and the
    per-step mask over the batch's constrained rows."""

    def __init__(self, ckpt: Checkpoint, vocab_size: int, tokenizer: Any = None):
        self.ckpt, self.vocab = ckpt, vocab_size  # the logits' width (the model's vocabulary)
        self.hf_tokenizer = tokenizer  # the leader passes the one it has; others load it on first use
        self._lltok = None
        self._words, self._own_eos = (vocab_size + 31) // 32, []  # mask words per row; llguidance's EOS
        self._templates: OrderedDict[tuple[str, str], Any] = OrderedDict()
        # Requests whose matcher raised this step (request id -> why): they fail alone, the batch goes on.
        self.failures: dict[str, str] = {}

    def _tokenizer(self):
        if self._lltok is None:
            import llguidance.hf

            tok = self.hf_tokenizer if self.hf_tokenizer is not None else load_tokenizer(self.ckpt)
            if tok is None:
                raise ValueError("structured outputs need the model's tokenizer")
            # Masks as wide as the logits (a model's vocabulary may exceed its tokenizer's). Its
            # own EOS choice does not matter: mask() sets every EOS bit per request.
            self._lltok = llguidance.hf.from_tokenizer(tok, n_vocab=max(self.vocab, len(tok)))
            self._words = (self._lltok.vocab_size + 31) // 32
            self._own_eos = [e for e in self._lltok.eos_tokens if e < self.vocab]
        return self._lltok

    def matcher(self, spec: StructuredOutputsParams):
        """A fresh matcher for one request (a copy of the spec's compiled template). Should the
        tokenizer defeat llguidance, the error is logged and the matcher is in an error state: the
        request ends at its first token rather than take this rank down."""
        from llguidance import LLMatcher

        key = spec.key()
        template = self._templates.pop(key, None)
        if template is None:
            try:
                template = LLMatcher(self._tokenizer(), grammar_of(*key), log_level=0)
            except Exception as e:
                log.error("structured outputs (%s) are unavailable on this model: %s", spec.describe(), e)
                return _Broken()
            if template.is_error():  # checked without a tokenizer when the request was made
                log.warning("structured outputs (%s) failed against this tokenizer: %s", spec.describe(),
                            one_line(template.get_error()))
        self._templates[key] = template
        while len(self._templates) > TEMPLATES:
            self._templates.popitem(last=False)
        return template.deep_copy()

    def mask(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """The logits ([len(reqs), vocab]) with -inf on every token the grammar forbids next, in the
        rows of constrained requests only (a copy: the model's logits are inference tensors)."""
        rows = [(i, r) for i, r in enumerate(reqs) if r.matcher is not None]
        if not rows:
            return logits
        bits = torch.empty((len(rows), self._words), dtype=torch.int32)
        complete = np.zeros(len(rows), dtype=np.bool_)
        for j, (_, r) in enumerate(rows):
            try:
                r.matcher.unsafe_compute_mask_ptr(bits[j].data_ptr(), self._words * 4)
                complete[j] = r.matcher.is_accepting()
            except Exception as e:  # this request fails; its row bans nothing meanwhile
                self._failed(r, e)
                bits[j] = -1
        # Bit t of the row's words (little-endian) is token t: unpacked, the complement is the ban.
        banned = np.unpackbits(np.invert(bits.numpy()).view(np.uint8), axis=1, count=self.vocab,
                               bitorder="little").view(np.bool_)
        # EOS: llguidance's stand-in never; the request's own only where the grammar is complete.
        banned[:, self._own_eos] = True
        ok = complete & np.array([not r.params.ignore_eos for _, r in rows])
        for eos in {r.eos_token_ids for _, r in rows}:  # one set in practice: the leader's
            js = [j for j, (_, r) in enumerate(rows) if r.eos_token_ids == eos]
            banned[np.ix_(js, [e for e in eos if e < self.vocab])] = ~ok[js, None]
        banned[banned.all(axis=1)] = False  # an error state, or complete with no EOS to end on: accept() ends it
        if len(rows) < len(reqs):  # unconstrained rows ban nothing
            full = np.zeros((len(reqs), self.vocab), dtype=np.bool_)
            full[[i for i, _ in rows]] = banned
            banned = full
        return logits.masked_fill(torch.from_numpy(banned).to(logits.device, non_blocking=True), float("-inf"))

    def accept(self, reqs: list[Request], tokens: list[int]) -> list[int]:
        """Feed each constrained request its sampled token; the positions (in `reqs`) of those
        whose output is now complete: EOS sampled, or the grammar can take nothing more."""
        ended = []
        for i, (r, tok) in enumerate(zip(reqs, tokens)):
            m = r.matcher
            if m is None:
                continue
            try:
                refused = not (tok in r.eos_token_ids or m.is_stopped()) and not m.consume_token(tok)
            except Exception as e:
                self._failed(r, e)
                continue
            if tok in r.eos_token_ids or m.is_stopped():
                ended.append(i)
            elif refused:
                log.warning("request %s: its grammar refused token %d (%s); ending it", r.request_id, tok,
                            one_line(m.get_error()))
                ended.append(i)
            elif m.is_stopped():
                ended.append(i)
        return ended


    def _failed(self, req: Request, e: Exception) -> None:
        why = f"the grammar engine failed on this request: {one_line(str(e)) or type(e).__name__}"
        log.error("request %s: %s", req.request_id, why)
        self.failures[req.request_id] = why


class _Broken:
    """A matcher that allows nothing: mask() leaves its row alone and accept() ends the request."""

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        ctypes.memset(ptr, 0, size)

    def is_accepting(self) -> bool:
        return False

    def is_stopped(self) -> bool:
        return True
