"""A draft model proposes: a smaller checkpoint with the target's vocabulary runs K steps ahead.

Where the draft lives (`--speculative-draft-tp`):
- `1`: whole in the leader's process. The plan carries its proposals to every other rank, so they
  need neither its weights nor its KV, and the draft runs no collective.
- `same`: sharded like the target over the tensor group, on every rank (stage_worker.py holds its
  runner). Each draft forward is then a plan of its own (StepPlan.draft) that every rank runs, with
  the draft's own all-reduces and LM-head gather (counted as the "draft" group).

Either way the leader's `DraftProposer` owns the draft's page allocator (no prefix cache) and,
per request, how many positions the draft's cache holds. Each step, per speculating request, it
first catches up on the tokens the draft has not seen (the whole prompt the first time, then what
the last verification emitted) and proposes the first token from that forward, then feeds each
proposal back for the next: K forwards for the batch in all. Greedy requests take the draft's
argmax; sampled ones draw from the draft's filtered distribution (temperature, top-k/p, min-p)
with a generator of their own, and that distribution goes with the proposal as q. After
verification the cache is rolled back to what the target kept (`settle`): pages holding only
rejected positions are freed.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from shardserve.config import MAX_SPECULATIVE_TOKENS, EngineConfig
from shardserve.core import Request
from shardserve.distributed.communicator import Communicator
from shardserve.distributed.groups import ParallelGroups
from shardserve.engine.model_runner import ModelRunner, StepInputs
from shardserve.engine.proposers import Proposal
from shardserve.engine.sampler import filter_logits, row_argmax
from shardserve.ipc.messages.plan import PlanEntry
from shardserve.kvcache.pages import PageAllocator
from shardserve.loader.model_path import resolve_checkpoint
from shardserve.loader.weights import read_model_config

log = logging.getLogger(__name__)
# A catch-up after a verification (at most its K+1 tokens) runs as decode rows, each attending
# over the cache up to its position, as the target's verification does; a longer chunk (a first
# prompt, or one after preemption) as a prefill.
DECODE_ROWS = MAX_SPECULATIVE_TOKENS + 1


@dataclass
class _DraftKV:
    pages: list[int] = field(default_factory=list)
    computed: int = 0  # positions whose draft KV is in `pages`
    proposed_at: int = 0  # the request's token count when the draft last proposed
    settling: bool = False  # proposed this step: `settle` rolls the cache back to what was kept
    generator: torch.Generator | None = None
    synced: int = 0  # leading pages the other ranks' copy shares (draft_tp same)


def draft_step(entries: list[PlanEntry], pages_of: dict[str, list[int]]) -> StepInputs:
    """A draft forward's inputs: each entry continues its sequence by its tokens (rows in entry
    order, catch-ups short enough as decode rows first); each entry's last row gives logits."""
    step = StepInputs([], [], [], [], [])
    for e in entries:
        pages, n = pages_of[e.rid], len(e.token_ids)
        step.token_ids.extend(e.token_ids)
        step.positions.extend(range(e.start, e.start + n))
        if n <= DECODE_ROWS:
            step.decodes.extend((pages, p + 1) for p in range(e.start, e.start + n))
        else:
            step.prefills.append((pages, n, e.start + n))
        step.logit_rows.append(len(step.positions) - 1)
    return step


def build_draft_runner(cfg: EngineConfig, device: torch.device, groups: ParallelGroups | None = None,
                       num_pages: int | None = None) -> ModelRunner:
    """The draft's ModelRunner: whole (no `groups`) or sharded over `groups`' tensor group, whose
    collectives it counts apart from the target's (as the "draft" group)."""
    spec = cfg.speculative_config
    ckpt = resolve_checkpoint(spec.model)
    # Block-quantized drafts run the float32 CPU kernels whatever the target's dtype; a draft's
    # KV cache is its own choice (--kv-cache-dtype is the target's: the draft's heads may not take it).
    dtype = "float32" if device.type == "cpu" else cfg.dtype
    dcfg = replace(cfg, model=spec.model, dtype=dtype, device=str(device), num_pages=num_pages,
                   enable_prefix_cache=False, speculative_config=None, quantization="auto", kv_cache_dtype="auto",
                   disaggregation_mode="null", pp_layer_partition=None, pp_micro_batches=None,
                   ep_num_redundant_experts=0, ep_expert_placement=None, enable_lora=False)
    if groups is not None:
        t = groups.tensor
        groups = replace(groups, tensor=Communicator(t.group, t.rank, t.size, "draft", t.members))
    log.info("speculative decoding: loading the draft %s (%s%s) ...", ckpt.name, dtype,
             f", sharded over {groups.tensor.size} tensor ranks" if groups is not None else "")
    return ModelRunner(dcfg, ckpt, read_model_config(ckpt), groups)


class DraftProposer:
    method = "draft"

    def __init__(self, cfg: EngineConfig, runner: ModelRunner,
                 execute: Callable[[list[PlanEntry]], torch.Tensor] | None = None):
        """`runner`: the draft (whole in this process, or this rank's shard); `execute` (sharded):
        runs one draft forward on every tensor rank and returns its logits (None: `runner` runs it
        here). The draft's pool has as many pages as the target's: every request it holds fits."""
        self.runner, self.execute = runner, execute or self._execute_here
        self.device = runner.device
        self.alloc = PageAllocator(runner.num_pages, cfg.page_size, prefix_cache=False)
        self.kv: dict[str, _DraftKV] = {}
        self.pool_full = 0  # requests that got no proposal because the draft's pool was full

    def _execute_here(self, entries: list[PlanEntry]) -> torch.Tensor:
        return self.runner.forward(draft_step(entries, {e.rid: self.kv[e.rid].pages for e in entries}))

    def _state(self, req: Request) -> _DraftKV:
        st = self.kv.get(req.request_id)
        if st is None:  # new, or preempted (`forget`): the draft recomputes it, as the target does
            seed = int.from_bytes(hashlib.sha256(f"draft:{req.seed}".encode()).digest()[:7], "little")
            gen = torch.Generator(device=self.device).manual_seed(seed)
            st = self.kv[req.request_id] = _DraftKV(generator=gen)
        return st

    def propose(self, reqs: list[Request], ks: list[int]) -> list[Proposal]:
        out = [Proposal([]) for _ in reqs]
        live = []  # (position in reqs, state, k)
        for i, (req, k) in enumerate(zip(reqs, ks)):
            st = self._state(req)
            # Positions fed: the tokens not yet seen, then proposals 1 .. k-1.
            if k > 0 and self.alloc.extend_to(st.pages, req.num_tokens + k - 1):
                st.proposed_at, st.settling = req.num_tokens, True
                live.append((i, st, k))
            elif k > 0:
                self.pool_full += 1
                if self.pool_full == 1:
                    log.warning("speculative decoding: the draft's KV pool is full; requests go without proposals "
                                "until pages free up (counted as draft_pool_full in the speculative counters)")
        if not live:
            return out
        probs: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in live}
        feed = {i: reqs[i].all_token_ids[st.computed :] for i, st, _ in live}
        for step in range(max(k for _, _, k in live)):
            batch = [(i, st) for i, st, k in live if k > step]
            logits = self._forward([(reqs[i], st, feed[i]) for i, st in batch])
            for (i, st), row in zip(batch, logits):
                tok, q = self._pick(row, reqs[i], st)
                out[i].tokens.append(tok)
                if q is not None:
                    probs[i].append(q)
                feed[i] = [tok]
        for i, _, _ in live:  # each state now holds positions up to proposal k-1 (the last is never fed)
            if probs[i]:
                out[i].probs = torch.stack(probs[i])
        return out

    def _forward(self, rows: list[tuple[Request, _DraftKV, list[int]]]) -> torch.Tensor:
        """One draft forward: each (request, state, tokens) continues its sequence by `tokens`;
        the logits of each one's last token, in the given order."""
        order = sorted(range(len(rows)), key=lambda j: len(rows[j][2]) > DECODE_ROWS)  # decode rows first
        entries = []
        for j in order:
            req, st, toks = rows[j]
            assert toks, f"request {req.request_id}: the draft's cache is ahead of the request"
            base = st.synced
            st.synced = len(st.pages)
            entries.append(PlanEntry(req.request_id, st.computed, toks, base, st.pages[base:], True))
            st.computed += len(toks)
        logits = self.execute(entries)
        back = {j: r for r, j in enumerate(order)}
        return logits[[back[j] for j in range(len(rows))]]

    def _pick(self, row: torch.Tensor, req: Request, st: _DraftKV) -> tuple[int, torch.Tensor | None]:
        p = req.params
        if p.greedy:
            return row_argmax(row[None])[0], None
        q = filter_logits(row.float(), p).softmax(-1)
        return int(torch.multinomial(q, 1, generator=st.generator)), q

    def settle(self, req: Request, accepted: int) -> None:
        st = self.kv.get(req.request_id)
        if st is None or not st.settling:
            return
        st.settling = False
        st.computed = min(st.computed, st.proposed_at + accepted)
        st.synced = min(st.synced, self.alloc.truncate(st.pages, st.computed))

    def forget(self, req: Request) -> None:
        st = self.kv.pop(req.request_id, None)
        if st is not None:
            self.alloc.release(st.pages)
