"""Turn one step's logits into tokens, honouring each request's SamplingParams.

Each request samples with its own torch.Generator (seeded from `seed`, or from the engine's
RNG when none is given), so a seeded request draws the same tokens whatever else is batched.
Log-probabilities are those of the model's raw distribution, before penalties or temperature,
as vLLM reports by default.
"""

from __future__ import annotations

import torch

from shardserve.core import Request, SamplingParams


def apply_penalties(logits: torch.Tensor, req: Request) -> torch.Tensor:
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        out = torch.tensor(req.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, as -inf masks on one row."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def top_logprobs(logprobs: torch.Tensor, token: int, k: int) -> dict:
    entry = {"token_id": token, "logprob": float(logprobs[token]), "top_logprobs": []}
    if k:
        vals, ids = logprobs.topk(k)
        entry["top_logprobs"] = [[int(i), float(v)] for i, v in zip(ids, vals)]
    return entry


# Rows per log-softmax when scoring a prompt: bounds the extra memory to this many vocab rows.
SCORE_BLOCK = 256


def score_prompt(logits: torch.Tensor, prompt: list[int], k: int, first_pos: int) -> list[dict]:
    """The logprob entries of prompt tokens first_pos+1 .. first_pos+len(logits), each with the
    top k (row i of `logits` scores the token after position first_pos + i)."""
    entries = []
    for b in range(0, len(logits), SCORE_BLOCK):
        lp = torch.log_softmax(logits[b : b + SCORE_BLOCK].float(), -1)
        pos = first_pos + 1 + b
        targets = torch.tensor(prompt[pos : pos + len(lp)], device=lp.device)
        chosen = lp.gather(1, targets[:, None]).squeeze(1).tolist()
        top_v, top_i = (t.tolist() for t in lp.topk(k, dim=-1)) if k else ([[]] * len(lp), [[]] * len(lp))
        for tok, val, ids, vals in zip(targets.tolist(), chosen, top_i, top_v):
            entries.append({"token_id": tok, "logprob": val, "top_logprobs": [[i, v] for i, v in zip(ids, vals)]})
    return entries


class Sampler:
    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[dict | None]]:
        """logits: [len(reqs), vocab]. Returns a token per request and, where asked, its logprobs."""
        logits = logits.float()
        want_lp = [r.params.logprobs is not None for r in reqs]
        raw_lp = torch.log_softmax(logits, -1) if any(want_lp) else None
        greedy_rows = [i for i, r in enumerate(reqs) if r.params.greedy and not _penalised(r.params)]
        greedy_set = set(greedy_rows)
        tokens = [0] * len(reqs)
        if greedy_rows:
            ids = logits[greedy_rows].argmax(-1).tolist()
            for i, t in zip(greedy_rows, ids):
                tokens[i] = t
        for i, r in enumerate(reqs):
            if i in greedy_set:
                continue
            row = apply_penalties(logits[i].clone(), r)
            if r.params.greedy:
                tokens[i] = int(row.argmax())
                continue
            probs = filter_logits(row, r.params).softmax(-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=r.generator))
        lps = [
            top_logprobs(raw_lp[i], tokens[i], r.params.logprobs) if want_lp[i] else None
            for i, r in enumerate(reqs)
        ]
        return tokens, lps


def _penalised(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
