"""One rank's engine loop: schedule, run the model, sample, and decide who finished.

The offline `LLM` drives this directly; the scheduler process of the server wraps it with
message I/O. It owns no tokenizer, only a `decode` function used to match stop strings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardserve.config import EngineConfig
from shardserve.core import Batch, Request, SamplingParams, Status
from shardserve.distributed.groups import ParallelGroups
from shardserve.engine.model_runner import ModelRunner
from shardserve.engine.sampler import Sampler, score_prompt
from shardserve.ipc.messages import Stats
from shardserve.kvcache.pages import PageAllocator
from shardserve.loader.model_path import Checkpoint, resolve_checkpoint
from shardserve.loader.weights import read_model_config
from shardserve.scheduler.scheduler import Scheduler


@dataclass
class StepOutput:
    """What one request gained this step (for streaming) and whether it is done."""

    request: Request
    new_token_ids: list[int]
    finished: bool


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit; also sent to other processes so they can refuse early."""

    vocab_size: int
    max_model_len: int
    num_pages: int
    page_size: int
    has_tokenizer: bool

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never run; nothing is truncated silently."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.max_model_len} tokens"
            )
        pages = -(-(n + params.max_tokens) // self.page_size)
        if pages > self.num_pages:
            raise ValueError(f"request needs {pages} KV pages but the pool holds {self.num_pages}")
        if params.stop and not self.has_tokenizer:
            raise ValueError("stop strings need a tokenizer")


class EngineCore:
    def __init__(self, cfg: EngineConfig, decode: Callable[[list[int], bool], str] | None = None,
                 groups: ParallelGroups | None = None, extra_eos: tuple[int, ...] = ()):
        self.cfg = cfg
        self.ckpt: Checkpoint = resolve_checkpoint(cfg.model)
        self.model_cfg = read_model_config(self.ckpt)
        self.runner = ModelRunner(cfg, self.ckpt, self.model_cfg, groups)
        self.control = self.runner.control
        limit = self.model_cfg.max_position_embeddings
        self.max_model_len = min(cfg.max_model_len or limit, limit)
        self.allocator = PageAllocator(self.runner.num_pages, cfg.page_size, cfg.enable_prefix_cache)
        self.scheduler = Scheduler(self.allocator, cfg.max_num_batched_tokens, cfg.max_running_requests)
        self.sampler = Sampler()
        self.decode = decode
        self.eos_ids = tuple(sorted(set(self.model_cfg.eos_token_ids) | set(extra_eos) | self._generation_eos()))
        self.requests: dict[str, Request] = {}
        self.num_steps = self.num_finished = 0
        self._seed_rng = torch.Generator().manual_seed(cfg.seed)

    def _generation_eos(self) -> set[int]:
        path = os.path.join(self.ckpt.path, "generation_config.json")
        if self.ckpt.is_gguf or not os.path.exists(path):
            return set()
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        return set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    @property
    def vocab_size(self) -> int:
        return self.model_cfg.vocab_size

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.vocab_size, self.max_model_len, self.allocator.num_pages, self.cfg.page_size,
                             self.decode is not None)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.limits.check(prompt_token_ids, params)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_token_ids, params)
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_rng))
        gen = torch.Generator(device=self.runner.device).manual_seed(seed)
        req = Request(request_id, list(prompt_token_ids), params, self.eos_ids, generator=gen)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return False
        self.num_finished += 1
        self.scheduler.finish(req, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        self.num_steps += 1
        sampled = batch.sampled()
        scoring = batch.prompt_scoring()
        logits = self.runner.forward(batch)
        row = len(sampled)
        for req, _, pos, count in scoring:
            score_prompt(logits[row : row + count], req, pos)
            row += count
        tokens, logprobs = self.sampler(logits[: len(sampled)], sampled)
        if self.control.size > 1 and tokens:
            # Ranks see identical logits, but float noise must never let them drift apart.
            tokens = self.control.broadcast(torch.tensor(tokens, dtype=torch.int64)).tolist()
        self.scheduler.advance(batch)
        outputs = []
        for req, tok, lp in zip(sampled, tokens, logprobs):
            req.output_token_ids.append(tok)
            if lp is not None:
                req.logprobs.append(lp)
            reason = self._finish_reason(req, tok)
            if reason:
                self.num_finished += 1
                self.scheduler.finish(req, reason)
                self.requests.pop(req.request_id, None)
            outputs.append(StepOutput(req, [tok], reason is not None))
        return outputs

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if tok in p.stop_token_ids:
            req.stop_reason = tok
            return "stop"
        if not p.ignore_eos and tok in req.eos_token_ids:
            return "stop"
        if p.stop and self._match_stop_string(req):
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _match_stop_string(self, req: Request) -> bool:
        text = self.decode(req.output_token_ids, req.params.skip_special_tokens)
        # Search all of it: a match may begin far before the newest token (one token can decode to
        # many characters), and the whole text is decoded each step anyway.
        hits = [(text.find(s), s) for s in req.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        req.text_cut, req.stop_reason = min(hits)
        return True

    def stats(self) -> Stats:
        s = self.running_status()
        return Stats(running=s["running"], waiting=s["waiting"], pages_used=s["pages_used"],
                     pages_total=s["pages_total"], prefix_hit_rate=self.allocator.hit_rate, steps=self.num_steps,
                     finished=self.num_finished,
                     traffic=self.runner.comm.traffic_report(), control=self.control.traffic_report())

    def traffic_by_group(self) -> dict:
        """This rank's counts on every group it is in: {"rank": r, "groups": {kind: report}}."""
        groups = self.runner.groups
        return {"rank": groups.rank, "groups": {kind: c.traffic_report() for kind, c in groups.communicators().items()
                                                if c.size > 1}}

    def running_status(self) -> dict[str, int]:
        return {
            "steps": self.num_steps,
            "finished": self.num_finished,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "pages_used": self.allocator.num_used,
            "pages_total": self.allocator.num_pages,
        }


__all__ = ["Batch", "EngineCore", "Status", "StepOutput"]
