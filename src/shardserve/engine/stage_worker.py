"""One rank's share of every step: apply the leader's plan, run this stage, sample on the last.

Every rank of an engine replica, the leader included, runs the same `StepPlan`s in the same
order: the leader makes them (scheduler/engine_core.py) and the fan-out delivers them in order
(scheduler/inbox.py). A rank keeps, for each request it has heard of, only what its own part
needs: the request's page list (attention reads it on every stage) and, on the one rank that
samples (the last stage's tensor rank 0), the sampling state: parameters, generator, tokens so far
and, with structured outputs, the grammar matcher (engine/grammar.py).

Because a plan fully describes its micro-batch (tokens, positions, pages), no rank ever decides
anything itself, so ranks cannot diverge; and because every stage runs micro-batches in plan
order, a page written by an earlier micro-batch is in every stage's cache before a later one
reads it.
"""

from __future__ import annotations

import gc

import torch

from shardserve.config import EngineConfig, ModelConfig
from shardserve.core import Request
from shardserve.distributed.groups import ParallelGroups
from shardserve.distributed.pipeline import StageLink, stage_of
from shardserve.engine.context_inputs import ContextSplit
from shardserve.engine.draft_proposer import build_draft_runner, draft_step
from shardserve.engine.grammar import Guide
from shardserve.engine.kv_shipper import KVShipper
from shardserve.engine.model_runner import ModelRunner, StepInputs
from shardserve.engine.sampler import Sampler, score_prompt
from shardserve.engine.step_rows import embeddings, finite_rows, pooled_rows
from shardserve.engine.verify import verify
from shardserve.ipc.messages.disagg import KVTarget
from shardserve.ipc.messages.plan import PENDING, PlanRequest, StepPlan, StepResult
from shardserve.kvcache.transfer import KVSender
from shardserve.loader.model_path import Checkpoint
from shardserve.multimodal import ImageInput, horizons, image_rows
from shardserve.platform import anon_rss_mb, peak_rss_mb


class StageWorker:
    def __init__(self, cfg: EngineConfig, ckpt: Checkpoint, model_cfg: ModelConfig, groups: ParallelGroups,
                 secret: bytes = b""):
        """`secret` keys the KV channels of a prefill instance (disaggregation)."""
        layout = groups.layout
        stage = stage_of(groups.coords.pp, model_cfg.num_layers, layout.pp, cfg.pp_layer_partition)
        # Micro-batches in flight: one per stage unless said otherwise (one stage runs one at a time).
        self.micro_batches = (cfg.pp_micro_batches or layout.pp) if layout.pp > 1 else 1
        self.runner = ModelRunner(cfg, ckpt, model_cfg, groups, stage)
        self.stage, self.hidden_size = stage, model_cfg.hidden_size
        self.samples = stage.last and groups.tensor.rank == 0 and groups.context.rank == 0
        r = self.runner
        self.split = (ContextSplit(groups.context, r.num_pages, cfg.page_size, r.device, stage.first)
                      if groups.context.size > 1 else None)
        self.link = (StageLink(groups.pipeline, stage, cfg.dist_timeout, self.micro_batches)
                     if stage.count > 1 else None)
        self.pages: dict[str, list[int]] = {}
        self.images: dict[str, tuple[ImageInput, ...]] = {}  # requests with images: theirs (multimodal.py)
        self.sampling: dict[str, Request] = {}  # on the sampling rank only
        self.sampler = Sampler()
        # Speculative decoding by a draft model: its distributions for a plan's proposals, handed
        # over by the leader in-process (the leader is this rank: speculation needs one stage).
        self.draft_probs: dict[str, torch.Tensor] = {}
        self.guide = Guide(ckpt, model_cfg.vocab_size) if self.samples else None  # structured outputs
        self.plans = self.empty_plans = 0  # run so far (empty: data-parallel attention's idle steps)
        # Disaggregation: a prefill rank ships KV (`shipper`, to `targets`); a decode rank's KV
        # receiver (set by its process) must stop writing a dropped room before the next plan runs.
        self.targets: dict[str, KVTarget] = {}
        self.shipper = (KVShipper(KVSender(secret, cfg.disaggregation_timeout), r.kv_views, cfg.page_size,
                                  model_cfg.num_heads, model_cfg.num_kv_heads, groups.tensor.size,
                                  groups.tensor.rank, r.device)
                        if cfg.disaggregation_mode == "prefill" else None)
        self.receiver = None
        # Speculative decoding by a draft model: its runner where it lives (sharded like the target
        # on every rank, or whole on the sampling rank, which is the leader) and, sharded, its pages.
        spec = cfg.speculative_config
        self.draft, self.draft_sharded = None, spec is not None and spec.draft_tp == "same"
        if spec is not None and spec.method == "draft" and cfg.disaggregation_mode != "prefill":
            if self.draft_sharded:
                self.draft = build_draft_runner(cfg, r.device, groups, num_pages=r.num_pages)
            elif self.samples:  # whole: as many pages as the target's over all its context ranks
                self.draft = build_draft_runner(cfg, r.device, num_pages=r.num_pages * groups.context.size)
        self.draft_pages: dict[str, list[int]] = {}
        # What loading made lives as long as the process: frozen, the collections that a step's
        # garbage triggers do not walk it again (~4% of a 32-stream decode step, measured).
        gc.collect()
        gc.freeze()

    def execute(self, plan: StepPlan) -> StepResult | None:
        """Run this rank's part of `plan`; the sampling rank returns the micro-batch's result."""
        self._learn(plan)
        if plan.draft:
            return self._draft_forward(plan)
        self.plans += 1
        self.empty_plans += not plan.entries
        step = self._inputs(plan)
        pooled = pooled_rows(plan.entries, self.sampling, step) if self.samples else []
        hidden = None
        if not self.stage.first:
            hidden = self.link.recv(len(step.positions), self.hidden_size, self.runner.dtype, self.runner.device)
        ships = self.shipper is not None and self.shipper.plan(plan.entries, self.pages, self.targets)
        out = self.runner.forward(step, hidden, self.shipper.after_layer if ships else None)
        if ships:
            self.shipper.finish()
        if not self.stage.last:
            self.link.send(out)
            return None
        if not self.samples:
            return None
        result = self._sample(plan, out)
        result.embeddings = embeddings(pooled, step.hidden)
        return result

    def _draft_forward(self, plan: StepPlan) -> torch.Tensor | None:
        """One forward of the sharded draft; its logits on the sampling rank (the leader)."""
        for e in plan.entries:  # a disaggregated decode's request may draft before a plan announces it
            pages = self.draft_pages.setdefault(e.rid, [])
            del pages[e.page_base :]
            pages.extend(e.new_pages)
        logits = self.draft.forward(draft_step(plan.entries, self.draft_pages))
        return logits if self.samples else None

    def _learn(self, plan: StepPlan) -> None:
        if plan.lora_ops:
            self.runner.lora.apply(plan.lora_ops)
        for room in plan.dropped:
            if self.receiver is not None:
                self.receiver.cancel(room)
        for rid in plan.done:
            self.pages.pop(rid, None)
            self.images.pop(rid, None)
            self.draft_pages.pop(rid, None)
            self.sampling.pop(rid, None)
            self.sampler.forget(rid)
            if self.targets.pop(rid, None) is not None:
                self.shipper.forget(rid)
            if self.split is not None:
                self.split.forget(rid)
        for r in plan.new:
            self.pages[r.rid] = []
            if r.images:
                self.images[r.rid] = tuple(r.images)
            if r.transfer is not None:
                self.targets[r.rid] = r.transfer
            if self.samples:
                self.sampling[r.rid] = self._sampling_request(r)

    def _sampling_request(self, r: PlanRequest) -> Request:
        """The sampling rank's copy of a request: its generator (seeded, or for a request whose
        first token a prefill instance sampled, in the state that instance left it) and tokens."""
        gen = torch.Generator(device=self.runner.device).manual_seed(r.seed)
        if r.rng_state:
            gen.set_state(torch.frombuffer(bytearray(r.rng_state), dtype=torch.uint8))
        req = Request(r.rid, r.prompt, r.params, tuple(r.eos), generator=gen, images=tuple(r.images))
        if r.params.structured_outputs is not None:
            req.matcher = self.guide.matcher(r.params.structured_outputs)
        for tok in r.output:  # the penalties and the grammar continue after them
            req.append_token(tok)
            if req.matcher is not None:
                req.matcher.consume_token(tok)
        return req

    def _inputs(self, plan: StepPlan) -> StepInputs:
        for e in plan.entries:
            pages = self.pages[e.rid]
            del pages[e.page_base:]
            pages.extend(e.new_pages)
        if self.split is not None:
            ids, positions, context = self.split.inputs(plan.entries, self.pages)
            return StepInputs(ids, positions, [], [], [], context, lora_slots=context.lora_slots)
        step = StepInputs([], [], [], [], [])
        sample_rows, score_rows, offset = [], [], 0
        pending: list[tuple[int, str]] = []  # --async-scheduling: (row, request) of each placeholder
        for e in plan.entries:
            pages = self.pages[e.rid]
            n = len(e.token_ids)
            end = e.start + n
            if self.stage.first:
                if e.token_ids[-1] == PENDING:
                    pending.append((len(step.token_ids) + n - 1, e.rid))
                step.token_ids.extend(e.token_ids)
            step.positions.extend(range(e.start, end))
            step.lora_slots.extend([e.lora_slot] * n)
            if n == 1 or e.num_draft == n - 1:
                # A decode; or a verification (its last token and the proposals, placed after the
                # plain decodes): each row attends as a decode over the cache up to its position,
                # every row's KV written first, so it computes what K+1 decode steps would.
                step.decodes.extend((pages, p + 1) for p in range(e.start, end))
            else:
                step.prefills.append((pages, n, end))
                step.horizons.append(self._horizons(e.rid, e.start, n))
            if self.stage.first and e.rid in self.images:
                step.images.extend((im, offset + row, first, count)
                                   for im, row, first, count in image_rows(self.images[e.rid], e.start, n))
            if e.sample:  # its last row, and with proposals the one before each of them
                sample_rows.extend(range(offset + n - 1 - e.num_draft, offset + n))
            if e.score_count:
                first = offset + e.score_first - e.start
                score_rows.extend(range(first, first + e.score_count))
            offset += n
        step.logit_rows = sample_rows + score_rows
        if not any(h is not None for h in step.horizons):
            step.horizons = []
        if pending:
            self._fill_pending(step.token_ids, pending)
        return step

    def _horizons(self, rid: str, start: int, n: int) -> list[int] | None:
        """Each row's context length as it attends, where the chunk meets an image (else None)."""
        seen = horizons(self.images.get(rid, ()), start, n)
        if seen is not None and max(seen) > start + n:  # the scheduler never cuts an image (multimodal.chunk_end)
            raise RuntimeError(f"a plan cut request {rid!r}'s image at position {start + n}")
        return seen

    def _fill_pending(self, ids: list[int], pending: list[tuple[int, str]]) -> None:
        """--async-scheduling: each placeholder is the token the sampling rank sampled for its
        request in the plan before, which every rank ran first (scheduler/overlap.py); the
        sampling rank sends them to the tensor group's other ranks, which embed them too."""
        tokens = [self._last_sampled(rid) for _, rid in pending] if self.samples else [0] * len(pending)
        tensor = self.runner.groups.tensor
        if tensor.size > 1:
            tokens = tensor.broadcast(torch.tensor(tokens, dtype=torch.int64, device=self.runner.device)).tolist()
        for (row, _), tok in zip(pending, tokens):
            ids[row] = tok

    def _last_sampled(self, rid: str) -> int:
        req = self.sampling.get(rid)
        if req is None or not req.output_token_ids:
            raise RuntimeError(f"a plan left request {rid!r}'s token to the sampling rank, which has sampled none "
                               "for it")
        return req.output_token_ids[-1]

    def _sample(self, plan: StepPlan, logits: torch.Tensor) -> StepResult:
        sampled = [e for e in plan.entries if e.sample]
        row = sum(e.num_draft + 1 for e in sampled)
        logits, failed = finite_rows(logits, row, sampled)
        if row == len(sampled):
            tokens, logprobs, ended = self._sample_rows(logits[:row], [self.sampling[e.rid] for e in sampled])
            accepted = ([], [])
        else:
            tokens, logprobs, ended, accepted = self._verify(logits[:row], sampled)
        scored = []
        for e in plan.entries:
            if e.score_count:
                req = self.sampling[e.rid]
                scored.append(score_prompt(logits[row : row + e.score_count], req.prompt_token_ids,
                                           req.params.prompt_logprobs, e.score_first))
                row += e.score_count
        if self.guide.failures:  # a matcher that raised fails its request alone
            failed |= {k: self.guide.failures[e.rid] for k, e in enumerate(sampled) if e.rid in self.guide.failures}
            self.guide.failures.clear()
        return StepResult(mb=plan.mb, tokens=tokens, logprobs=logprobs, prompt_logprobs=scored, ended=ended,
                          accepted=accepted[0], accepted_logprobs=accepted[1], failed=failed)

    def _sample_rows(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list, list[int]]:
        """One token per request from its one row (the batched sampler)."""
        guided = any(r.matcher is not None for r in reqs)
        tokens, logprobs = self.sampler(logits, reqs, self.guide.mask if guided else None)
        ended = self.guide.accept(reqs, tokens) if guided else []
        for req, tok in zip(reqs, tokens):
            req.append_token(tok)  # penalties read the tokens so far
        return tokens, logprobs, ended

    def _verify(self, logits: torch.Tensor, sampled: list) -> tuple[list[int], list, list[int], tuple]:
        """Speculative decoding: entries without proposals sample together, each with proposals
        is verified row by row (engine/verify.py). Per sampled entry: its last token and logprob,
        and in `accepted` (tokens, logprobs) the proposals it emits before that token."""
        starts, at = [], 0
        for e in sampled:
            starts.append(at)
            at += e.num_draft + 1
        plain = [i for i, e in enumerate(sampled) if not e.num_draft]
        plain_out = {}
        if plain:
            toks, lps, done = self._sample_rows(logits[[starts[i] for i in plain]],
                                                [self.sampling[sampled[i].rid] for i in plain])
            plain_out = {i: ([toks[j]], [lps[j]], j in done) for j, i in enumerate(plain)}
        tokens, logprobs, ended, accepted = [], [], [], ([], [])
        for i, e in enumerate(sampled):
            if not e.num_draft:
                toks, lps, done = plain_out[i]
            else:
                q = self.draft_probs.pop(e.rid, None)
                toks, lps, done = verify(logits[starts[i] : starts[i] + e.num_draft + 1], self.sampling[e.rid],
                                         e.token_ids[1:], q, self.sampler, self.guide)
            tokens.append(toks[-1])
            logprobs.append(lps[-1])
            accepted[0].append(toks[:-1])
            accepted[1].append(lps[:-1])
            if done:
                ended.append(i)
        return tokens, logprobs, ended, accepted

    def info(self) -> dict:
        """What every rank reports when ready. Peak resident memory so far covers model
        construction and weight loading (the KV pool is allocated untouched), so layouts compare."""
        r = self.runner
        return {"peak_load_rss_mb": round(peak_rss_mb(), 1), "anon_rss_mb": round(anon_rss_mb(), 1),
                "attention": r.attention.describe(), "layers": [r.stage.start, r.stage.end],
                "num_pages": r.num_pages, "weight_mb": r.weight_mb, "quantization": r.quantization,
                "draft_weight_mb": self.draft.weight_mb if self.draft is not None else 0.0}

    def rank_report(self) -> dict:
        """This rank's traffic by group and, for a MoE model, its routing counts (rank reports)."""
        report = self.runner.groups.traffic_by_group() | {"plans": self.plans, "empty_plans": self.empty_plans}
        if self.draft_sharded and self.draft is not None:  # the sharded draft's own collectives
            report["groups"]["draft"] = self.draft.comm.traffic_report()
        experts = self.runner.expert_counts()
        return report | {"experts": experts} if experts else report

    def flush(self) -> None:
        """Wait for this stage's outstanding sends (before a rank-wide collective or exit)."""
        if self.link is not None:
            self.link.flush()
