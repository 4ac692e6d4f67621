"""The leader's plans (ipc StepPlan), one per micro-batch: its entries, and what else the other
ranks must learn before they run it."""

from __future__ import annotations

from shardserve.core import Batch, Request
from shardserve.ipc.messages.plan import PENDING, LoraOp, PlanEntry, PlanRequest, StepPlan

# A request the plan's result answers: (request, samples a token, scores prompt tokens).
Wait = tuple[Request, bool, bool]


class PlanFeed:
    """Builds each StepPlan. Between plans it collects what the other ranks have not heard of
    yet: requests new to them (sent with their first entry), announced requests that ended, and
    (disaggregated decode) transfer rooms given up."""

    def __init__(self) -> None:
        self.new: list[PlanRequest] = []
        self.done: list[str] = []
        self.dropped: list[str] = []
        self.lora_ops: list[LoraOp] = []

    def plan(self, mb: int, entries: list[PlanEntry], draft: bool = False) -> StepPlan:
        """Plan `mb`, carrying (and clearing) everything collected since the last one."""
        plan = StepPlan(mb=mb, entries=entries, new=self.new, done=self.done, dropped=self.dropped, draft=draft,
                        lora_ops=self.lora_ops)
        self.new, self.done, self.dropped, self.lora_ops = [], [], [], []
        return plan

    def batch_plan(self, mb: int, batch: Batch) -> tuple[StepPlan, list[Wait]]:
        """Plan `mb` for `batch`, and the requests waiting for its result, in plan order."""
        scoring = {id(req): (pos, count) for req, _, pos, count in batch.prompt_scoring()}
        entries, waits = [], []
        for req, n in batch.entries:
            if not req.announced:
                req.announced = True
                # The sampling rank bans EOS before min_tokens and lets a grammar end on it.
                p = req.params
                eos = list(req.eos_token_ids) if p.structured_outputs is not None or p.min_tokens else []
                self.new.append(PlanRequest(req.request_id, req.prompt_token_ids, req.params, req.seed, eos,
                                            req.transfer, list(req.output_token_ids), req.rng_state,
                                            list(req.images)))
            start = req.num_computed_tokens
            sample = start + n == req.num_planned
            ids = req.all_token_ids[start : start + n]
            ids += [PENDING] * (n - len(ids))  # --async-scheduling: a token still being sampled
            first, count = scoring.get(id(req), (-1, 0))
            base = req.pages_synced
            req.pages_synced = len(req.pages)
            draft = batch.drafts.get(req.request_id, [])
            entries.append(PlanEntry(req.request_id, start, ids + draft, base,
                                     req.pages[base:], sample, first, count, len(draft), req.lora_slot))
            if sample or count:
                waits.append((req, sample, count > 0))
        return self.plan(mb, entries), waits
