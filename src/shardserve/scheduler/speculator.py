"""Speculative decoding on the leader: which decodes get proposals, and what verification left.

After the scheduler picks a step's batch, each decoding request may be given up to K proposed
tokens (engine/proposers.py); its plan entry then carries its last token and the proposals, so
the target computes K+1 positions of it in one forward (a decode with several query tokens over
the paged cache) and the sampling rank verifies them (engine/verify.py). The KV bookkeeping:

- At plan time only the request's last token counts as computed (as for a plain decode); the
  proposals' positions get pages (taken from the free pool only: speculation never preempts).
- When the result comes, the accepted proposals' positions count as computed too and their full
  pages go to the prefix cache; pages that hold only rejected positions are freed. A page is
  published only once every position in it is verified, so the cache never serves a rejected
  token (a rejected position's KV is overwritten when the request gets there).

With more than `disable_by_batch_size` requests in the step nothing is proposed: verification
costs compute that a big batch no longer has spare. Speculation needs the result of a step
before the next is planned, so it runs with one pipeline stage (launch/checks.py refuses more).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from shardserve.config import EngineConfig, SpeculativeConfig
from shardserve.core import Batch, Request
from shardserve.engine.proposers import NgramProposer, Proposal, Proposer
from shardserve.kvcache.pages import PageAllocator

log = logging.getLogger(__name__)


@dataclass
class SpecCounts:
    """vLLM's counters: drafts (request-steps given proposals), proposed, accepted and emitted
    tokens (accepted plus the target's own token), and accepted counts by proposal position."""

    method: str
    drafts: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    per_position: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"method": self.method, "drafts": self.drafts, "proposed": self.proposed,
                "accepted": self.accepted, "emitted": self.emitted, "per_position": list(self.per_position)}


class Speculator:
    def __init__(self, spec: SpeculativeConfig, proposer: Proposer, alloc: PageAllocator, max_model_len: int,
                 max_num_batched_tokens: int):
        self.spec, self.proposer, self.alloc = spec, proposer, alloc
        self.max_model_len, self.budget = max_model_len, max_num_batched_tokens
        self.counts = SpecCounts(proposer.method, per_position=[0] * spec.num_speculative_tokens)
        self.pending: dict[str, int] = {}  # request id -> proposals in the plan in flight

    def extend(self, batch: Batch) -> dict[str, Proposal]:
        """Give the batch's decodes their proposals (in `batch.drafts`, entries reordered so plain
        decodes stay first); returns them by request id."""
        limit = self.spec.disable_by_batch_size
        if limit is not None and len(batch.entries) > limit:
            return {}
        room = self.budget - batch.num_tokens
        reqs, ks = [], []
        for req, n in batch.entries:
            k = min(self._room(req), room) if n == 1 else 0
            if k > 0:
                reqs.append(req)
                ks.append(k)
                room -= k
        if not reqs:
            return {}
        drafts = {}
        for req, prop in zip(reqs, self.proposer.propose(reqs, ks)):
            prop.tokens = prop.tokens[: self._grow(req, len(prop.tokens))]
            if not prop.tokens:  # none, or no page for them: the proposer keeps none of its work
                self.proposer.settle(req, 0)
            else:
                if prop.probs is not None:
                    prop.probs = prop.probs[: len(prop.tokens)]
                drafts[req.request_id] = prop
                self.pending[req.request_id] = len(prop.tokens)
        batch.drafts = {rid: p.tokens for rid, p in drafts.items()}
        # Rows: plain decodes, then verifications (decode rows too), then prompt chunks.
        batch.entries.sort(key=lambda e: 2 if e[1] != 1 else int(e[0].request_id in drafts))
        batch.num_decode = sum(1 for r, n in batch.entries if n == 1 and r.request_id not in drafts)
        return drafts

    def report(self) -> dict:
        """The counters for Stats: SpecCounts', and the request-steps the proposer left without
        proposals because its own KV pool was full (`draft_pool_full`)."""
        return self.counts.as_dict() | {"draft_pool_full": self.proposer.pool_full}

    def _room(self, req: Request) -> int:
        """Proposals a decode may take: K, fewer near max_tokens or the model's length (verification
        emits up to one token more than it accepts). Prompt scoring and disaggregated prefill
        requests get none."""
        p = req.params
        if req.transfer is not None or (p.prompt_logprobs is not None and not req.output_token_ids):
            return 0
        if req.num_computed_tokens + 1 != req.num_tokens:  # a one-token prompt chunk (the budget cut it)
            return 0
        return min(self.spec.num_speculative_tokens, p.max_tokens - len(req.output_token_ids) - 1,
                   self.max_model_len - req.num_tokens - 1)

    def _grow(self, req: Request, k: int) -> int:
        """Pages for k proposals' positions (from the free pool only); how many fit."""
        self.alloc.extend_to(req.pages, req.num_tokens + k)
        return max(0, min(k, len(req.pages) * self.alloc.page_size - req.num_tokens))

    def settle(self, req: Request, accepted: int, emitted: int) -> None:
        """Verification kept `accepted` of the request's proposals; `emitted` tokens were appended
        (fewer than accepted + 1 where a stop inside the run ended the request)."""
        k = self.pending.pop(req.request_id, 0)
        if not k:
            return
        c = self.counts
        c.drafts += 1
        c.proposed += k
        c.accepted += accepted
        c.emitted += emitted
        for i in range(accepted):
            c.per_position[i] += 1
        if req.finished:
            return
        req.num_computed_tokens += accepted
        self.alloc.register(req.cache_key, req.pages, req.num_computed_tokens, req.page_hashes,
                            req.cache_root)
        keep = self.alloc.truncate(req.pages, req.num_computed_tokens)
        req.pages_synced = min(req.pages_synced, keep)
        self.proposer.settle(req, accepted)

    def forget(self, req: Request) -> None:
        """The request ended (its proposals in flight, if any, are still counted by `settle`)."""
        self.proposer.forget(req)


def make_speculator(cfg: EngineConfig, worker, alloc: PageAllocator, max_model_len: int,
                    run_draft: Callable | None = None) -> Speculator | None:
    """The leader's speculator for `cfg.speculative_config` (None: off, or a prefill instance,
    which only ever samples a request's first token). `run_draft(entries)`: one forward of a draft
    sharded over the tensor group (StageWorker.draft), as a plan every rank runs."""
    spec = cfg.speculative_config
    if spec is None:
        return None
    if cfg.disaggregation_mode == "prefill":
        log.info("speculative decoding is off on a prefill instance (it samples only first tokens); "
                 "the decode instances speculate")
        return None
    if spec.method == "ngram":
        proposer = NgramProposer(spec.ngram_min, spec.ngram_max)
    else:
        from shardserve.engine.draft_proposer import DraftProposer

        proposer = DraftProposer(cfg, worker.draft, run_draft if worker.draft_sharded else None)
    log.info("speculative decoding: %s, %d tokens a step, off above %s requests a step", spec.method,
             spec.num_speculative_tokens, spec.disable_by_batch_size)
    return Speculator(spec, proposer, alloc, max_model_len, cfg.max_num_batched_tokens)
