"""Turn one step's logits into tokens, honouring each request's SamplingParams.

Each request samples with its own torch.Generator (seeded from `seed`, or from the engine's
RNG when none is given), so a seeded request draws the same tokens whatever else is batched.
Each row goes: raw logits, bans (allowed_token_ids, bad_words, min_tokens), logit_bias,
penalties, temperature, top-k/top-p/min-p, as in vLLM's sampler. Log-probabilities are those
of the model's raw distribution, before bans, bias, penalties or temperature, as vLLM reports
by default.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardserve.core import Request
from shardserve.engine.batch_sampling import sample_rows
from shardserve.layers import cpu_ops
from shardserve.sampling_params import SamplingParams


class _Tally:
    """Occurrences of each vocabulary id in a token list that only grows, on the logits' device,
    brought up to date from the tokens added since the last call (O(new tokens))."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.counts = torch.zeros(vocab, dtype=torch.long, device=device)
        self.upto = 0  # how many of the list's tokens `counts` holds

    def update(self, tokens: list[int]) -> torch.Tensor:
        if len(tokens) < self.upto:  # not expected (lists only grow): start over rather than be wrong
            self.counts.zero_()
            self.upto = 0
        if len(tokens) > self.upto:
            new = torch.tensor(tokens[self.upto :], dtype=torch.long, device=self.counts.device)
            self.counts.index_add_(0, new, torch.ones_like(new))
            self.upto = len(tokens)
        return self.counts


class PenaltyState:
    """What the penalties need from one request's tokens so far (O(new tokens) a step, not
    O(context)): a tally of prompt and output tokens (repetition_penalty reads which were seen)
    and one of output tokens (presence/frequency penalties), each made on the first step that
    needs it."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.all: _Tally | None = None
        self.output: _Tally | None = None

    def update_seen(self, tokens: list[int]) -> torch.Tensor:
        """bool [vocab]: every token of `tokens` (prompt and output)."""
        self.all = self.all or _Tally(self.vocab, self.device)
        return self.all.update(tokens) > 0

    def update_counts(self, tokens: list[int]) -> torch.Tensor:
        """long [vocab]: occurrences in `tokens` (the output)."""
        self.output = self.output or _Tally(self.vocab, self.device)
        return self.output.update(tokens)


def apply_penalties(logits: torch.Tensor, req: Request, states: dict[str, PenaltyState]) -> torch.Tensor:
    """Repetition penalty over prompt and output (Hugging Face rule), presence and frequency
    penalties over the output (OpenAI rule), in place on one row of logits. `states` holds each
    request's PenaltyState by request id (the caller forgets it when the request ends)."""
    p = req.params
    want_rep = p.repetition_penalty != 1.0
    want_out = bool(p.presence_penalty or p.frequency_penalty) and bool(req.output_token_ids)
    if not (want_rep or want_out):
        return logits
    state = states.get(req.request_id)
    if state is None or state.vocab != logits.shape[-1] or state.device != logits.device:
        state = states[req.request_id] = PenaltyState(logits.shape[-1], logits.device)
    if want_rep:
        seen = state.update_seen(req.all_token_ids)
        rp = p.repetition_penalty
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits))
    if want_out:
        counts = state.update_counts(req.output_token_ids).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def banned_tokens(req: Request, vocab: int, device: torch.device) -> torch.Tensor | None:
    """bool [vocab]: what the request may not sample next (vLLM's rules), or None for nothing.
    Every token outside `allowed_token_ids`; each bad word's last token where the output ends in
    the rest of the word (a one-token word always); before `min_tokens`, EOS and the stop tokens.
    Ids beyond the logits are dropped (the server refuses them earlier). Were every token banned,
    nothing is: sampling from an empty distribution would fail the whole batch."""
    p, out = req.params, req.output_token_ids
    ids: list[int] = []
    for seq in p.bad_words_token_ids or ():
        n = len(seq) - 1
        if seq and (n == 0 or (len(out) >= n and out[-n:] == seq[:-1])):
            ids.append(seq[-1])
    if len(out) < p.min_tokens:
        ids += p.stop_token_ids + ([] if p.ignore_eos else list(req.eos_token_ids))
    ids = [t for t in ids if t < vocab]
    if p.allowed_token_ids is None and not ids:
        return None
    if p.allowed_token_ids is None:
        mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    else:
        mask = torch.ones(vocab, dtype=torch.bool, device=device)
        mask[[t for t in p.allowed_token_ids if t < vocab]] = False
    mask[ids] = True
    return None if bool(mask.all()) else mask


def apply_logit_bias(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Add the request's logit_bias (token id -> bias) to one row of logits, in place."""
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
        bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        logits.index_add_(0, ids, bias)
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
    """One row's entry (speculative verification's rows, one at a time): as `batch_logprobs`."""
    return batch_logprobs(logprobs[None], [token], [k])[0]


def batch_logprobs(raw_lp: torch.Tensor | None, tokens: list[int], ks: list[int | None]) -> list[dict | None]:
    """Each row's entry as `top_logprobs` gives it (None where `ks` is), from one top-k over the
    rows that ask and three copies to the host, not two per entry."""
    rows = [i for i, k in enumerate(ks) if k is not None]
    out: list[dict | None] = [None] * len(ks)
    if not rows:
        return out
    lp = raw_lp[rows]
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in rows], device=lp.device)[:, None]).squeeze(1).tolist()
    most = max(ks[i] for i in rows)
    vals, ids = (t.tolist() for t in lp.topk(most, dim=-1)) if most else ([[]] * len(rows), [[]] * len(rows))
    for j, i in enumerate(rows):
        k = ks[i]
        out[i] = {"token_id": tokens[i], "logprob": chosen[j],
                  "top_logprobs": [[t, v] for t, v in zip(ids[j][:k], vals[j][:k])]}
    return out


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
        # vLLM's rank: 1 + how many tokens the model found likelier than the prompt's.
        ranks = (lp > torch.tensor(chosen, device=lp.device)[:, None]).sum(-1).add(1).tolist()
        for tok, val, rank, ids, vals in zip(targets.tolist(), chosen, ranks, top_i, top_v):
            entries.append({"token_id": tok, "logprob": val, "rank": rank,
                            "top_logprobs": [[i, v] for i, v in zip(ids, vals)]})
    return entries


class Sampler:
    """Samples a batch's rows; keeps each request's penalty state by request id (what the
    penalties need from the tokens so far), which `forget` drops when the request ends."""

    def __init__(self) -> None:
        self.penalties: dict[str, PenaltyState] = {}

    def forget(self, request_id: str) -> None:
        self.penalties.pop(request_id, None)

    def adjust(self, row: torch.Tensor, req: Request) -> torch.Tensor:
        """One row's logits (a copy) after the request's bans, logit_bias and penalties: what its
        greedy argmax or its temperature and filters start from."""
        row = row.clone()
        ban = banned_tokens(req, row.shape[-1], row.device)
        if ban is not None:
            row.masked_fill_(ban, float("-inf"))
        return apply_penalties(apply_logit_bias(row, req.params), req, self.penalties)

    def __call__(self, logits: torch.Tensor, reqs: list[Request],
                 mask: Callable[[torch.Tensor, list[Request]], torch.Tensor] | None = None,
                 ) -> tuple[list[int], list[dict | None]]:
        """logits: [len(reqs), vocab]. Returns a token per request and, where asked, its logprobs.
        `mask` bans tokens (structured outputs, engine/grammar.py) after the raw logprobs are taken."""
        logits = logits.float()
        want_lp = [r.params.logprobs is not None for r in reqs]
        raw_lp = torch.log_softmax(logits, -1) if any(want_lp) else None
        if mask is not None:
            logits = mask(logits, reqs)
        greedy_rows = [i for i, r in enumerate(reqs) if r.params.greedy and not _adjusted(r)]
        greedy_set = set(greedy_rows)
        tokens = [0] * len(reqs)
        if greedy_rows:
            ids = row_argmax(logits if len(greedy_rows) == len(reqs) else logits[greedy_rows])
            for i, t in zip(greedy_rows, ids):
                tokens[i] = t
        # The other rows: each one's bans, bias and penalties on its own copy, then the greedy ones'
        # argmax and the sampled ones drawn together (batch_sampling), each with its generator.
        rest = [i for i in range(len(reqs)) if i not in greedy_set]
        if rest:
            adjusted = [j for j, i in enumerate(rest) if _adjusted(reqs[i])]
            rows = logits if len(rest) == len(reqs) and not adjusted else logits[rest]  # a copy where written
            for j in adjusted:
                rows[j] = self.adjust(rows[j], reqs[rest[j]])
            argmax = [j for j, i in enumerate(rest) if reqs[i].params.greedy]
            drawn = [j for j, i in enumerate(rest) if not reqs[i].params.greedy]
            for j, t in zip(argmax, row_argmax(rows[argmax]) if argmax else []):
                tokens[rest[j]] = t
            if drawn:
                picked = sample_rows(rows[drawn], [reqs[rest[j]].params for j in drawn],
                                     [reqs[rest[j]].generator for j in drawn])
                for j, t in zip(drawn, picked):
                    tokens[rest[j]] = t
        return tokens, batch_logprobs(raw_lp, tokens, [r.params.logprobs if w else None
                                                        for r, w in zip(reqs, want_lp)])


def row_argmax(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, the first of equal maxima (a NaN counts as the maximum), as torch's.
    On the CPU: several rows on the C kernel's threads, one in numpy (its one pass is the
    quicker alone); torch's CPU argmax over a vocabulary takes several times longer, which
    every decode step would pay."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        if logits.shape[0] > 1 and (ids := cpu_ops.rows_argmax(logits)) is not None:
            return ids
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def _adjusted(r: Request) -> bool:
    """Whether the row's logits change before the argmax (so greedy cannot take the raw one)."""
    p = r.params
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or bool(p.logit_bias) or p.allowed_token_ids is not None or bool(p.bad_words_token_ids)
            or len(r.output_token_ids) < p.min_tokens)
