"""A draft model proposes: a smaller checkpoint with the target's vocabulary runs K steps ahead.

The draft lives whole in the leader's process (`--speculative-draft-tp 1`): the plan carries its
proposals to every other rank, so they need neither its weights nor its KV, and the draft runs no
collective. It has its own KV pool and page allocator (no prefix cache), and for each request a
count of the positions its cache holds. Each step, per speculating request, it first catches up
on the tokens it has not seen (the whole prompt the first time, then the tokens the last
verification emitted) and proposes the first token from that forward, then feeds each proposal
back for the next: K forwards for the batch in all. Greedy requests take the draft's argmax;
sampled ones draw from the draft's filtered distribution (its temperature, top-k/p, min-p) with a
generator of their own, and that distribution goes with the proposal as q. After verification
the cache is rolled back to what the target kept (`settle`): pages holding only rejected
positions are freed.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, replace

import torch

from shardserve.config import EngineConfig
from shardserve.core import Request
from shardserve.engine.model_runner import ModelRunner, StepInputs
from shardserve.engine.proposers import Proposal
from shardserve.engine.sampler import filter_logits
from shardserve.kvcache.pages import PageAllocator
from shardserve.loader.model_path import resolve_checkpoint
from shardserve.loader.weights import read_model_config

log = logging.getLogger(__name__)


@dataclass
class _DraftKV:
    pages: list[int] = field(default_factory=list)
    computed: int = 0  # positions whose draft KV is in `pages`
    proposed_at: int = 0  # the request's token count when the draft last proposed
    preemptions: int = 0
    generator: torch.Generator | None = None


class DraftProposer:
    method = "draft"

    def __init__(self, cfg: EngineConfig, device: torch.device, num_pages: int):
        """`num_pages`: as many as the target's pool, so every request the target holds fits."""
        spec = cfg.speculative_config
        ckpt = resolve_checkpoint(spec.model)
        self.model_cfg = read_model_config(ckpt)
        # Block-quantized drafts run the float32 CPU kernels whatever the target's dtype.
        dtype = "float32" if device.type == "cpu" else cfg.dtype
        dcfg = replace(cfg, model=spec.model, dtype=dtype, device=str(device), num_pages=num_pages,
                       enable_prefix_cache=False, speculative_config=None, quantization="auto",
                       disaggregation_mode="null", pp_layer_partition=None, pp_micro_batches=None,
                       ep_num_redundant_experts=0, ep_expert_placement=None)
        log.info("speculative decoding: loading the draft %s (%s) ...", ckpt.name, dtype)
        self.runner = ModelRunner(dcfg, ckpt, self.model_cfg)
        self.page_size = cfg.page_size
        self.alloc = PageAllocator(self.runner.num_pages, cfg.page_size, prefix_cache=False)
        self.kv: dict[str, _DraftKV] = {}

    def _state(self, req: Request) -> _DraftKV:
        st = self.kv.get(req.request_id)
        if st is None or st.preemptions != req.num_preemptions:  # preempted: recompute, as the target does
            if st is not None:
                self.alloc.release(st.pages)
            seed = int.from_bytes(hashlib.sha256(f"draft:{req.seed}".encode()).digest()[:7], "little")
            gen = torch.Generator(device=self.runner.device).manual_seed(seed)
            st = self.kv[req.request_id] = _DraftKV(preemptions=req.num_preemptions, generator=gen)
        return st

    def _grow(self, st: _DraftKV, num_tokens: int) -> bool:
        need = -(-num_tokens // self.page_size) - len(st.pages)
        if need <= 0:
            return True
        pages = self.alloc.allocate(need)
        if pages is None:
            return False
        st.pages.extend(pages)
        return True

    def propose(self, reqs: list[Request], ks: list[int]) -> list[Proposal]:
        out = [Proposal([]) for _ in reqs]
        live = []  # (position in reqs, state, k)
        for i, (req, k) in enumerate(zip(reqs, ks)):
            st = self._state(req)
            # Positions fed: the tokens not yet seen, then proposals 1 .. k-1.
            if k > 0 and self._grow(st, req.num_tokens + k - 1):
                st.proposed_at = req.num_tokens
                live.append((i, st, k))
        if not live:
            return out
        probs: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in live}
        feed = {i: reqs[i].all_token_ids[st.computed :] for i, st, _ in live}
        for step in range(max(k for _, _, k in live)):
            batch = [(i, st) for i, st, k in live if k > step]
            logits = self._forward([(st, feed[i]) for i, st in batch])
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

    def _forward(self, rows: list[tuple[_DraftKV, list[int]]]) -> torch.Tensor:
        """One draft forward: each (state, tokens) continues its sequence by `tokens`; the logits
        of each one's last token, in the given order."""
        order = sorted(range(len(rows)), key=lambda j: len(rows[j][1]) != 1)  # decodes first
        step = StepInputs([], [], [], [], [])
        last, at = {}, 0
        for j in order:
            st, toks = rows[j]
            start, n = st.computed, len(toks)
            step.token_ids.extend(toks)
            step.positions.extend(range(start, start + n))
            (step.decodes.append((st.pages, start + 1)) if n == 1 else step.prefills.append((st.pages, n, start + n)))
            at += n
            last[j] = at - 1
            st.computed = start + n
        step.logit_rows = [last[j] for j in order]
        logits = self.runner.forward(step)
        back = {j: r for r, j in enumerate(order)}
        return logits[[back[j] for j in range(len(rows))]]

    def _pick(self, row: torch.Tensor, req: Request, st: _DraftKV) -> tuple[int, torch.Tensor | None]:
        p = req.params
        if p.greedy:
            return int(row.argmax()), None
        q = filter_logits(row.float(), p).softmax(-1)
        return int(torch.multinomial(q, 1, generator=st.generator)), q

    def settle(self, req: Request, accepted: int) -> None:
        st = self.kv.get(req.request_id)
        if st is None:
            return
        st.computed = min(st.computed, st.proposed_at + accepted)
        keep = -(-st.computed // self.page_size)
        self.alloc.release(st.pages[keep:])
        del st.pages[keep:]

    def forget(self, req: Request) -> None:
        st = self.kv.pop(req.request_id, None)
        if st is not None:
            self.alloc.release(st.pages)
