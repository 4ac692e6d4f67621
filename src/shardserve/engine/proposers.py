"""Speculative decoding's proposers: given decoding requests, propose up to K next tokens each.

A proposer is what the leader's speculator (scheduler/speculator.py) asks each step; the target
model then verifies the proposals in one forward (engine/verify.py). The interface is small so
that other kinds can plug in (an EAGLE-style head or multi-token prediction would also need the
target's hidden states at the verified rows, which the runner does not keep yet, and its own KV
like the draft model's):

- `propose(reqs, ks)`: one `Proposal` per request, at most ks[i] tokens (fewer, or none, is fine);
- `settle(req, accepted)`: after verification, how many of the request's proposals the target
  kept (a proposer with its own KV rolls back the rest);
- `forget(req)`: the request ended or was preempted (free what the proposer holds for it);
- `pool_full`: how many times a request went without proposals for want of the proposer's own
  KV pages (counted, and said once in the log: never a silent fallback).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from shardserve.core import Request


@dataclass
class Proposal:
    """Proposed tokens and, where they were sampled, the proposer's distribution for each
    ([len(tokens), vocab], the q of the acceptance rule); None: each proposal is certain."""

    tokens: list[int]
    probs: object = None  # a torch.Tensor (kept untyped: this module does not import torch)


class Proposer(Protocol):
    method: str
    pool_full: int

    def propose(self, reqs: list[Request], ks: list[int]) -> list[Proposal]: ...

    def settle(self, req: Request, accepted: int) -> None: ...

    def forget(self, req: Request) -> None: ...


def ngram_lookup(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt lookup: the longest suffix of `tokens` (n_max down to n_min tokens) that occurred
    before, and the up to k tokens that followed its most recent earlier occurrence."""
    a = np.asarray(tokens, dtype=np.int64)
    length = len(a)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # Windows starting 0 .. length-1-n: each is followed by at least one token.
        hits = np.flatnonzero((sliding_window_view(a[: length - 1], n) == a[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return a[start : start + k].tolist()
    return []


class NgramProposer:
    """vLLM's prompt lookup (`ngram`): proposals copied from the request's own prompt and output,
    which pays where the output repeats its input (edits, code, quoting). Costs no model."""

    method = "ngram"
    pool_full = 0  # it holds no KV

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, reqs: list[Request], ks: list[int]) -> list[Proposal]:
        return [Proposal(ngram_lookup(r.all_token_ids, self.n_min, self.n_max, k)) for r, k in zip(reqs, ks)]

    def settle(self, req: Request, accepted: int) -> None:
        pass

    def forget(self, req: Request) -> None:
        pass
