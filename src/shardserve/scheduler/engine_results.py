"""What comes of a step: `StepOutput` (one request's new tokens) and `EngineResultsMixin`, the
part of EngineCore that collects the micro-batches' results, applies them to their requests
and decides who finished (a stop, the context limit, an error of its own, a transfer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardserve.core import Request
from shardserve.distributed.communicator import CollectiveError
from shardserve.ipc.messages.plan import StageTraffic, StepResult
from shardserve.scheduler.finish import finish_reason


@dataclass
class StepOutput:
    """What one request gained this step (for streaming) and whether it is done. Made as its
    tokens are appended: what it reports of them is taken from the request then, since one
    step can apply two results of a request (--async-scheduling) before anything is sent."""

    request: Request
    new_token_ids: list[int]
    finished: bool
    grammar_done: bool = False  # structured outputs: the grammar is complete after this token
    logprobs: list[dict] | None = field(init=False)  # the new tokens' entries, where asked for
    first: bool = field(init=False)  # holds the request's first sampled tokens (prompt logprobs go with them)

    def __post_init__(self) -> None:
        r, n = self.request, len(self.new_token_ids)
        self.logprobs = (r.logprobs[len(r.logprobs) - n:] if n else []) if r.params.logprobs is not None else None
        self.first = n > 0 and len(r.output_token_ids) == n


class EngineResultsMixin:
    """EngineCore's results: applied as they come back (`_collect`), waited for when stalled
    (`wait_result`) or before a collective (`drain`). The engine provides the plans in flight
    (`inflight`, `results`, `executor`), its `_end` and what decides a finish (`decode`,
    `max_model_len`, `spec`)."""

    def wait_result(self, timeout_ms: int) -> list[StepOutput]:
        """Apply results arriving within `timeout_ms` (when stalled)."""
        return self._collect(timeout_ms)

    def drain(self) -> list[StepOutput]:
        """Wait for every micro-batch in flight (before a collective all ranks must join)."""
        outputs = []
        while self.inflight:
            outputs += self._collect(100)
        return outputs

    def _collect(self, timeout_ms: int) -> list[StepOutput]:
        if self.results is None:
            return []
        outputs = []
        for msg in self.results(timeout_ms):
            if isinstance(msg, StageTraffic):
                self.stage_traffic[str(msg.stage)] = msg.groups
                self.stage_reports += 1
            else:
                outputs += self._apply(msg)
        mb = self.inflight.overdue(self.cfg.dist_timeout) if self.executor is None else None
        if mb is not None:  # an executor's plan may run long: it is this process, not a lost stage
            raise CollectiveError(f"rank {self.runner.groups.rank}: no result for micro-batch {mb} from the last "
                                  f"pipeline stage within {self.cfg.dist_timeout:.0f} s")
        return outputs

    def _apply(self, result: StepResult) -> list[StepOutput]:
        waits = self.inflight.take(result.mb)
        self.starved = False
        tokens = iter(zip(result.tokens, result.logprobs))
        accepted = iter(zip(result.accepted, result.accepted_logprobs)) if result.accepted else None
        scored = iter(result.prompt_logprobs)
        ended, k = set(result.ended), -1
        outputs = []
        for req, sample, scores in waits:
            entries = next(scored) if scores else []
            tok, lp = next(tokens) if sample else (None, None)
            toks, lps = next(accepted) if sample and accepted else ([], [])
            k += sample  # position among the sampled entries
            if req.finished:  # aborted while its micro-batch was in flight
                continue
            req.prompt_logprobs.extend(entries)
            if req.request_id in result.embeddings:
                req.embedding = result.embeddings[req.request_id]
            if sample and k in result.failed:  # this request alone: its token is void, the batch goes on
                req.error = result.failed[k]
                self._end(req, "error")
                outputs.append(StepOutput(req, [], True))
            elif tok is not None:
                outputs.append(self._take_tokens(req, [*toks, tok], [*lps, lp], k in ended))
                if self.spec is not None:
                    self.spec.settle(req, len(toks), len(outputs[-1].new_token_ids))
        return outputs

    def _take_tokens(self, req: Request, toks: list[int], lps: list[dict | None], grammar_done: bool) -> StepOutput:
        """Append a step's tokens (several with speculative decoding) one at a time, stopping at
        the first that ends the request: a stop inside an accepted run cuts the output there."""
        for i, (tok, lp) in enumerate(zip(toks, lps)):
            req.append_token(tok)
            if lp is not None:
                req.logprobs.append(lp)
            if req.transfer is not None:  # disaggregated prefill: the decode instance takes it from here
                self._end(req, "transferred")
                return StepOutput(req, toks[: i + 1], True, grammar_done)
            last = i == len(toks) - 1
            reason = finish_reason(req, tok, self.decode, self.max_model_len)
            if reason != "stop" and grammar_done and last:  # structured outputs: the grammar is complete
                reason = "stop"
            if reason:
                self._end(req, reason)
                return StepOutput(req, toks[: i + 1], True, grammar_done and last)
        return StepOutput(req, toks, False, grammar_done)
