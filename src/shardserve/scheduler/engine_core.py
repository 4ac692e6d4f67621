"""One rank's engine loop: schedule, run the model, sample, and decide who finished.

The offline `LLM` drives this directly; the scheduler process of the server wraps it with
message I/O. It owns no tokenizer, only a `decode` function used to match stop strings.
Results and finishes (StepOutput, EngineResultsMixin) are engine_results.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

from shardserve.config import EngineConfig
from shardserve.core import Batch, Request, Status
from shardserve.distributed.groups import ParallelGroups, single_process_groups
from shardserve.engine.stage_worker import StageWorker
from shardserve.ipc.messages.plan import StepPlan
from shardserve.ipc.messages.reports import Stats
from shardserve.kvcache.pages import PageAllocator
from shardserve.loader.generation_config import eos_ids
from shardserve.loader.lora import base_shapes
from shardserve.loader.model_path import Checkpoint, resolve_checkpoint
from shardserve.loader.weights import read_model_config, resolve_dtype
from shardserve.multimodal import ImageInput
from shardserve.sampling_params import SamplingParams
from shardserve.scheduler.engine_results import EngineResultsMixin, StepOutput
from shardserve.scheduler.engine_stats import engine_stats, running_status
from shardserve.scheduler.in_flight import InFlightPlans
from shardserve.scheduler.limits import RequestLimits, images_refused
from shardserve.scheduler.lora_slots import LoraSlots
from shardserve.scheduler.overlap import Executor
from shardserve.scheduler.plan_feed import PlanFeed
from shardserve.scheduler.scheduler import Scheduler
from shardserve.scheduler.speculator import make_speculator


class EngineCore(EngineResultsMixin):
    """The leader's engine: requests, scheduling, plans, and what came of them.

    `step()` makes progress in one of two ways: it applies any results that came back, and when
    fewer than `micro_batches` plans are in flight it schedules the next micro-batch from requests
    in none of them, hands the plan to the other ranks (`publish`) and runs this rank's stage of
    it. With one stage the result comes back at once; with several, the last stage's sampling rank
    sends it (`results`), and a request is scheduled again only once its token is known.
    """

    def __init__(self, cfg: EngineConfig, decode: Callable[[list[int], bool], str] | None = None,
                 groups: ParallelGroups | None = None,
                 publish: Callable[[StepPlan], None] | None = None,
                 results: Callable[[int], list] | None = None, tokenizer=None, secret: bytes = b""):
        """`tokenizer`: its EOS id ends generations too, structured outputs may use it and,
        where no `decode` is given, stop strings are matched in its text; a Future of one (None
        where the checkpoint has none) is awaited once the model is built. `secret` keys a
        prefill instance's KV channels (disaggregation)."""
        groups = groups or single_process_groups()
        self.ckpt: Checkpoint = resolve_checkpoint(cfg.model)
        self.model_cfg = read_model_config(self.ckpt)
        self.cfg = cfg = resolve_dtype(cfg, self.ckpt, self.model_cfg)  # --dtype auto: see resolve_dtype
        self.worker = StageWorker(cfg, self.ckpt, self.model_cfg, groups, secret)
        if isinstance(tokenizer, Future):
            tokenizer = tokenizer.result()
        if decode is None and tokenizer is not None:
            def decode(ids: list[int], skip: bool) -> str:
                return tokenizer.decode(ids, skip_special_tokens=skip)
        if self.worker.guide is not None:  # this rank samples: structured outputs may use its tokenizer
            self.worker.guide.hf_tokenizer = tokenizer
        self.micro_batches = self.worker.micro_batches
        self.runner = self.worker.runner
        self.control = self.runner.control
        self.max_model_len = self.model_cfg.served_length(cfg.max_model_len)
        # Context parallelism: one pool per context rank, each request's pages spread over them.
        cp = groups.context.size
        self.allocator = PageAllocator(self.runner.num_pages * cp, cfg.page_size, cfg.enable_prefix_cache, parts=cp)
        self.scheduler = Scheduler(self.allocator, cfg.max_num_batched_tokens, cfg.max_running_requests,
                                   cfg.scheduling_policy)
        self.decode = decode
        self.eos_ids = eos_ids(self.ckpt, self.model_cfg, tokenizer)
        self.requests: dict[str, Request] = {}
        self.num_steps = self.num_finished = 0
        self.next_mb = 0  # plan number: steps and (data-parallel attention) empty steps alike
        self.empty_steps = 0
        # Seeds for requests that give none; each replica draws its own sequence, or the k-th
        # unseeded request of every replica (say the n choices of one request) would sample alike.
        replica = groups.coords.dp
        self._seed_rng = torch.Generator().manual_seed(cfg.seed if replica == 0 else hash((cfg.seed, replica)))
        self.publish, self.results = publish, results
        self.inflight = InFlightPlans(groups.rank)
        self.starved = False  # nothing was schedulable while plans were in flight
        self.feed = PlanFeed()  # what the next plan carries besides its entries
        self.stage_traffic: dict[str, dict] = {}
        self.stage_reports = 0  # StageTraffic messages received (a change worth a Stats message)
        self.loras = (LoraSlots(cfg.max_loras, cfg.cpu_loras, cfg.max_lora_rank, base_shapes(self.model_cfg), self.feed)
                      if cfg.enable_lora else None)
        self.scheduler.loras = self.loras
        self.spec = make_speculator(cfg, self.worker, self.allocator, self.max_model_len, self._run_draft)
        if self.spec is not None:  # a preempted request's draft KV is freed with its own
            self.scheduler.on_preempt = self.spec.forget
        # --async-scheduling: this rank's plans run on an executor thread, one planned ahead.
        self.executor = None
        self.depth = self.micro_batches  # plans in flight at most
        if cfg.async_scheduling:
            self.executor = Executor(self.worker.execute, f"rank {groups.rank} executor")
            self.results, self.depth = self.executor.results, 2

    @property
    def vocab_size(self) -> int:
        return self.model_cfg.vocab_size

    @property
    def limits(self) -> RequestLimits:
        v = self.model_cfg.vision
        images = dict(image_token=v.image_token_id, image_tokens=v.mm_tokens_per_image, image_size=v.image_size,
                      images_refused=images_refused(self.cfg, self.runner.attention.name,
                                                                    v.mm_tokens_per_image)) if v else {}
        return RequestLimits(self.vocab_size, self.max_model_len, self.allocator.num_pages, self.cfg.page_size,
                             self.decode is not None, self.allocator.parts, self.model_cfg.hidden_size,
                             self.cfg.scheduling_policy == "priority", **images)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      images: tuple[ImageInput, ...] = ()) -> None:
        self.limits.check(prompt_token_ids, params, images)

    def resolve_seed(self, params: SamplingParams) -> int:
        """The request's seed, or the next of this replica's sequence for a request giving none."""
        return params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_rng))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    seed: int | None = None, transfer=None, images: tuple[ImageInput, ...] = ()) -> Request:
        """`seed` already resolved (disaggregation: by the decode instance); `transfer` (a
        prefill instance): where the KV goes, layer by layer; the request ends after one token."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_token_ids, params, images)
        if params.lora_request is not None:
            if self.loras is None:
                raise ValueError(f"LoRA adapter {params.lora_request.lora_name!r} asked for, but this engine serves "
                                 "none: start it with --enable-lora (LLM(enable_lora=True))")
            self.loras.register(params.lora_request)
        seed = self.resolve_seed(params) if seed is None else seed
        req = Request(request_id, list(prompt_token_ids), params, self.eos_ids, seed=seed, transfer=transfer,
                      images=tuple(images))
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.starved = False
        return req

    def admit_transferred(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                          pages: list[int], first: int, rng_state: bytes, logprobs: dict | None = None,
                          prompt_logprobs: list[dict] | None = None, cached_tokens: int = 0,
                          grammar_done: bool = False) -> StepOutput:
        """Disaggregated decode: a request whose prompt KV a prefill instance wrote into `pages`
        and whose first token it sampled joins as if swapped out right after its prefill."""
        req = Request(request_id, list(prompt_token_ids), params, self.eos_ids, seed=seed, pages=list(pages),
                      num_computed_tokens=len(prompt_token_ids), num_cached_tokens=cached_tokens,
                      rng_state=rng_state)
        if prompt_logprobs:
            req.prompt_logprobs = list(prompt_logprobs)
        self.requests[request_id] = req
        self.scheduler.admit_running(req)
        self.starved = False
        return self._take_tokens(req, [first], [logprobs], grammar_done)

    def drop_room(self, room: str) -> None:
        """Disaggregated decode: every rank stops writing KV frames of `room` before the next plan
        runs (its pages may be handed out again by then)."""
        self.feed.dropped.append(room)

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return False
        self._end(req, "abort")
        self.starved = False
        return True

    def _end(self, req: Request, reason: str) -> None:
        if self.spec is not None:
            self.spec.forget(req)
        if req.params.lora_request is not None and self.loras is not None:
            self.loras.unregister(req.params.lora_request)
        self.num_finished += 1
        self.scheduler.finish(req, reason)
        self.requests.pop(req.request_id, None)
        if req.announced:
            self.feed.done.append(req.request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.inflight)

    def stalled(self) -> bool:
        """Whether only a result can let the engine move on (the caller may wait for one; under
        --async-scheduling `step` waits itself)."""
        return (self.executor is None and bool(self.inflight)
                and (len(self.inflight) >= self.micro_batches or self.starved))

    def step(self, join: bool = False) -> list[StepOutput]:
        """`join` (data-parallel attention, one stage): when nothing is schedulable, run a plan
        with no tokens, so this replica's ranks still enter every MoE layer's all-to-all that the
        other replicas' forwards enter this step."""
        outputs = self._collect(0)
        batch = None
        if len(self.inflight) < self.depth:
            blocked = self.inflight.blocked(self.executor is not None, self.requests, self.max_model_len)
            batch = self.scheduler.schedule(blocked, self._seq_cap())
            if batch is None:
                self.starved = bool(self.inflight)
                if join:
                    self._run_empty()
            else:
                outputs += self._run(batch)
        if self.executor is not None and self.inflight and (len(self.inflight) >= self.depth or batch is None):
            outputs += self._collect(int(self.cfg.dist_timeout * 1000))  # the oldest plan's result
        return outputs

    @property
    def max_in_flight(self) -> int:
        return self.inflight.most

    def _run_empty(self) -> None:
        plan = self.feed.plan(self.next_mb, [])
        self.next_mb += 1
        self.empty_steps += 1
        if self.publish is not None:
            self.publish(plan)
        self.worker.execute(plan)

    def _run_draft(self, entries: list) -> torch.Tensor:
        """One forward of the draft sharded over the tensor group: a plan every rank runs; the
        logits come back from this rank's share (it samples)."""
        plan = self.feed.plan(self.next_mb, entries, draft=True)
        self.next_mb += 1
        if self.publish is not None:
            self.publish(plan)
        return self.worker.execute(plan)

    def _seq_cap(self) -> int:
        """Split the active requests evenly over the micro-batches, so each slot has work."""
        if self.micro_batches == 1:
            return self.cfg.max_running_requests
        active = len(self.scheduler.running) + len(self.scheduler.waiting)
        return max(1, -(-active // self.micro_batches))

    def _run(self, batch: Batch) -> list[StepOutput]:
        if self.spec is not None:
            drafts = self.spec.extend(batch)
            # A draft model's distributions go to the sampling rank, which is this process.
            self.worker.draft_probs.update({rid: d.probs for rid, d in drafts.items() if d.probs is not None})
        plan, waits = self.feed.batch_plan(self.next_mb, batch)
        # Tokens count as computed as soon as they are planned: every stage runs plans in order,
        # so a later micro-batch never reads a page before this one has written it.
        self.scheduler.advance(batch)
        self.num_steps += 1
        self.next_mb += 1
        self.inflight.add(plan.mb, waits)
        if self.publish is not None:
            self.publish(plan)
        if self.executor is not None:
            self.executor.submit(plan)
            return []
        result = self.worker.execute(plan)
        return self._apply(result) if result is not None else []

    def close(self) -> None:
        """Stop the executor thread (--async-scheduling) after the plans in flight."""
        if self.executor is not None:
            self.executor.close()

    def stats(self) -> Stats:
        """What /metrics shows of this engine."""
        return engine_stats(self)

    def traffic_by_group(self) -> dict:
        """This rank's rank report: traffic by group (and routing counts for a MoE model)."""
        return self.worker.rank_report()

    def running_status(self) -> dict[str, int]:
        """The counts whose change is worth a Stats message."""
        return running_status(self)

__all__ = ["Batch", "EngineCore", "RequestLimits", "Status", "StepOutput"]
