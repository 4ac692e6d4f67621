"""Which requests run this step, and how many tokens each: continuous batching with a budget.

Every step: running requests first (oldest first), each taking its next chunk of uncomputed
tokens (one for a decode, up to the remaining budget for a prompt being prefilled in chunks);
if the page pool cannot hold a chunk, the newest running request is preempted (its pages freed,
recomputed later) until it fits. Then, if nothing was preempted, waiting requests are admitted
in order (by arrival under the default policy) while budget, pages and `max_running_requests`
allow, starting after whatever prefix of their tokens the prefix cache already holds.

Under the "priority" policy (vLLM's) "oldest" and "newest" read as most and least urgent: requests
are ordered by (SamplingParams.priority, arrival), lower first, in the running set, the waiting
queue and the choice of whom to preempt. A waiting request never preempts a running one; a
running one that needs room preempts the least urgent.

With micro-batches in flight (pipeline parallelism), requests whose result is still on its way
(`busy`) are neither scheduled nor preempted, and each micro-batch takes at most `max_seqs`
requests so the next one has some left to take. Under --async-scheduling a decode whose token is
on its way is scheduled again (`Request.pending`: its next row is a placeholder). It may also be
preempted: its token lands before the next schedule, so before it can be admitted again.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable

from shardserve.core import Batch, Request, Status
from shardserve.kvcache.pages import PageAllocator
from shardserve.multimodal import chunk_end
from shardserve.scheduler.lora_slots import LoraSlots


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_num_batched_tokens: int, max_running_requests: int,
                 policy: str = "fcfs"):
        self.alloc = allocator
        self.by_priority = policy == "priority"
        self.page_size = allocator.page_size
        self.max_tokens, self.max_running = max_num_batched_tokens, max_running_requests
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.on_preempt: Callable[[Request], None] | None = None  # speculative decoding frees the draft's KV
        self.loras: LoraSlots | None = None  # --enable-lora: a request runs only in its adapter's slot

    def add(self, req: Request) -> None:
        self._wait(req)

    def _key(self, req: Request) -> tuple[int, int]:
        return (req.params.priority if self.by_priority else 0, req.arrival)

    def _wait(self, req: Request) -> None:
        """Into the waiting queue at its place: by arrival (a preempted request goes first), or by
        (priority, arrival)."""
        if not self.by_priority:
            if req.num_preemptions:
                self.waiting.appendleft(req)
            else:
                self.waiting.append(req)
            return
        key = self._key(req)
        if not self.waiting or self._key(self.waiting[-1]) <= key:  # the common case: no search
            self.waiting.append(req)
        else:
            self.waiting.insert(bisect.bisect_right(self.waiting, key, key=self._key), req)

    def admit_running(self, req: Request) -> None:
        """A request whose KV is already in its pages (disaggregated decode) joins the running set."""
        req.status = Status.RUNNING
        self.running.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, busy: set[str] = frozenset(), max_seqs: int | None = None) -> Batch | None:
        budget = self.max_tokens
        max_seqs = max_seqs or self.max_running
        entries: list[tuple[Request, int]] = []
        queue = sorted((r for r in self.running if r.request_id not in busy), key=self._key)
        preempted = False
        while queue and budget > 0 and len(entries) < max_seqs:
            req = queue.pop(0)
            n = self._chunk(req, req.num_planned - req.num_computed_tokens, budget)
            if n == 0:  # the rest of an image does not fit what is left of this step's budget
                continue
            while not self.alloc.extend_to(req.pages, req.num_computed_tokens + n):
                victim = queue.pop() if queue else req
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                entries.append((req, n))
                budget -= n
        if not preempted:
            budget = self._admit(entries, budget, max_seqs)
        if not entries:
            return None
        # Decodes (one token) first: the attention backend batches them as one call.
        entries.sort(key=lambda e: e[1] != 1)
        return Batch(entries, sum(1 for _, n in entries if n == 1))

    def _chunk(self, req: Request, left: int, budget: int) -> int:
        """How many of `req`'s `left` uncomputed tokens it takes this step: all the budget allows,
        but never part of an image (multimodal.chunk_end; 0 where the image does not fit)."""
        n = min(left, budget)
        if req.images and n < left:
            start = req.num_computed_tokens
            n = chunk_end(req.images, start, start + n) - start
            n = 0 if n > budget else n
        return n

    def _admit(self, entries: list[tuple[Request, int]], budget: int, max_seqs: int) -> int:
        # A request whose adapter has no slot yet waits in its place; those behind it may go.
        passed: list[Request] = []
        try:
            return self._admit_in_order(entries, budget, max_seqs, passed)
        finally:
            self.waiting.extendleft(reversed(passed))

    def _admit_in_order(self, entries: list[tuple[Request, int]], budget: int, max_seqs: int,
                        passed: list[Request]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_running and len(entries) < max_seqs:
            req = self.waiting[0]
            if not self._acquire_slot(req):
                passed.append(self.waiting.popleft())
                continue
            tokens = req.cache_key
            # Cached tokens are never computed, so a request scoring or pooling its prompt cannot use them.
            computes_prompt = req.computes_prompt
            req.pages = [] if computes_prompt else self.alloc.match_prefix(tokens, req.cache_root)
            req.pages_synced = 0
            req.num_computed_tokens = len(req.pages) * self.page_size
            n = self._chunk(req, req.num_tokens - req.num_computed_tokens, budget)
            if n == 0 or not self.alloc.extend_to(req.pages, req.num_computed_tokens + n):
                self.alloc.release(req.pages)
                req.pages, req.num_computed_tokens = [], 0
                self._release_slot(req)
                break
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
                if not computes_prompt:
                    self.alloc.record_lookup(len(tokens), req.num_computed_tokens)
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            entries.append((req, n))
            budget -= n
        return budget

    def _acquire_slot(self, req: Request) -> bool:
        """Whether `req` may run: it needs no adapter, or its adapter has a slot it now holds."""
        lora = req.params.lora_request
        if lora is None or self.loras is None:
            return True
        slot = self.loras.acquire(lora)
        req.lora_slot = -1 if slot is None else slot
        return slot is not None

    def _release_slot(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.loras.release(req.params.lora_request)
            req.lora_slot = -1

    def _preempt(self, req: Request) -> None:
        self._release_slot(req)
        self.running.remove(req)
        self.alloc.release(req.pages)
        req.pages, req.num_computed_tokens, req.pages_synced = [], 0, 0
        req.page_hashes.clear()
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.on_preempt is not None:
            self.on_preempt(req)
        self._wait(req)

    def advance(self, batch: Batch) -> None:
        """Mark the batch's tokens computed and publish newly full pages to the prefix cache."""
        for req, n in batch.entries:
            req.num_computed_tokens += n
            # A placeholder's token (--async-scheduling) is unknown yet: its page waits for a later step.
            self.alloc.register(req.cache_key, req.pages, min(req.num_computed_tokens, req.num_tokens),
                                req.page_hashes, req.cache_root)

    def finish(self, req: Request, reason: str) -> None:
        """End a request (done or aborted) wherever it is, freeing its pages."""
        self._release_slot(req)
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        # A failed request's own KV may be what went wrong: it is not served to later prompts.
        failed = req.num_cached_tokens // self.page_size if reason == "error" else None
        self.alloc.release(req.pages, forget_from=failed)
        req.pages = []
        req.status = Status.FINISHED
        req.finish_reason = reason
