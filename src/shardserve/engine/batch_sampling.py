"""Drawing a step's sampled rows together: temperature, top-k, top-p and min-p as batched tensor
operations, then each row's token by inverting its distribution's CDF at one uniform number drawn
from the request's own generator (so a seeded request draws the same tokens whatever shares its
step: every operation below is one row's alone, and which candidates decide a row depends on that
row alone).

Why not a row at a time: over a 49k vocabulary on the CPU one row's softmax, full sort (top-p) and
multinomial took 1 to 5 ms, so 64 sampled streams spent longer sampling than in the forward pass.

A truncating row (top-k or top-p) starts from its largest logits, sorted: STAGES of 64, 1024 and
4096, each for the rows the one before left open, then the whole vocabulary sorted. Its kept set
is exact among candidates when the last candidate is itself dropped: top-k (a value threshold),
top-p (the mass before a token only grows down the order) and min-p (a fraction of the largest
probability) then drop everything after it too. A peaked row (most rows of a chat) is decided by
its first 64; a flat one (a high temperature under top-p 0.95) may need the sort.
"""

from __future__ import annotations

import torch

from shardserve.sampling_params import SamplingParams

STAGES = (64, 1024, 4096)  # the sorted candidates of a truncating row, each stage for rows the last left open


def truncates(p: SamplingParams, vocab: int) -> bool:
    """Whether the row's kept set depends on the order of its logits (top-k or top-p)."""
    return 0 < p.top_k < vocab or p.top_p < 1.0


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `logits` [n, vocab] (float32, bans and penalties already applied),
    each row under its params (temperature > 0) and drawn with its generator."""
    n, vocab = logits.shape
    dev = logits.device
    u = torch.cat([torch.rand(1, dtype=torch.float64, generator=g, device=dev) for g in generators])
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
    x = logits / temps[:, None]
    picked = torch.empty(n, dtype=torch.long, device=dev)
    whole = [i for i, p in enumerate(params) if not truncates(p, vocab)]
    if whole:  # x itself where every row is one (the function writes over its rows)
        rows = x if len(whole) == n else x[whole]
        picked[whole] = _whole_rows(rows, [params[i] for i in whole], u[whole])
    todo = [i for i, p in enumerate(params) if truncates(p, vocab)]
    # A row without top-k normalises over its whole vocabulary: once, not once a stage.
    lse = torch.logsumexp(x[todo], -1, keepdim=True) if any(not 0 < params[i].top_k < vocab for i in todo) else None
    for k in (*STAGES, vocab):  # the whole vocabulary decides every row
        if not todo:
            break
        tokens, exact = _candidate_rows(x[todo], [params[i] for i in todo], u[todo], min(k, vocab), lse)
        decided = exact.tolist()
        picked[[i for i, d in zip(todo, decided) if d]] = tokens[exact]
        todo = [i for i, d in zip(todo, decided) if not d]
        lse = lse[~exact] if lse is not None else None
    return picked.tolist()


def _whole_rows(x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Rows with no truncation by order: exp(x - max), each a probability over the largest one,
    less min-p's tail (a probability under min_p times the largest), drawn from. Overwrites x."""
    e = x.sub_(x.amax(-1, keepdim=True)).exp_()
    if any(p.min_p > 0 for p in params):  # asked of the params, not the device
        min_p = torch.tensor([p.min_p for p in params], dtype=e.dtype, device=x.device)
        e = e * (e >= min_p[:, None])
    return inverse_cdf(e, u)


def _candidate_rows(x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor, k: int,
                    row_lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with top-k or top-p, from their k largest logits: (a token per row, whether the
    candidates decided it: the tokens of the other rows are not to be used). `row_lse`: each
    row's log-sum-exp over its whole vocabulary (None where every row has top-k)."""
    vocab, dev = x.shape[1], x.device
    vals, ids = torch.topk(x, k, dim=-1) if k < vocab else x.sort(-1, descending=True)  # largest first
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=x.dtype, device=dev)
    min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype, device=dev)
    has_k = (top_k > 0)[:, None]
    # top-k keeps every logit at least the k-th largest (ties included, as filter_logits does).
    kth = vals.gather(1, (top_k - 1).clamp(0, k - 1)[:, None])
    keep = ~has_k | (vals >= kth)
    masked = vals.masked_fill(~keep, float("-inf"))
    # The probabilities after top-k: normalised over what it keeps, else over the whole row.
    lse = torch.logsumexp(masked, -1, keepdim=True)
    if row_lse is not None:
        lse = torch.where(has_k, lse, row_lse)
    probs = torch.exp(masked - lse)
    keep &= probs.cumsum(-1) - probs < top_p[:, None]  # the token that crosses top_p is kept
    keep &= probs >= min_p[:, None] * probs[:, :1]
    # Decided where the last candidate is dropped, or has probability 0 (and so has every token
    # after it), and top-k's threshold lay among the candidates; or every token is a candidate.
    exact = ((~keep[:, -1] | (probs[:, -1] == 0)) & (top_k <= k)) | (k == vocab)
    # Drawn in vocabulary order, as the whole rows are: the same uniform number picks the same
    # token whichever stage decides the row. The whole vocabulary is put back in place, not sorted.
    if k == vocab:
        return inverse_cdf(torch.zeros_like(probs).scatter_(1, ids, probs * keep), u), exact
    ids, order = ids.sort(-1)
    j = inverse_cdf((probs * keep).gather(1, order), u)
    return ids.gather(1, j[:, None]).squeeze(1), exact


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of non-negative float32 `weights` [n, m] (not normalised), the first index whose
    running sum exceeds u (float64, in [0, 1)) times the row's total: a draw from those weights in
    which a zero weight is never drawn. Raises ValueError for a row with no finite positive weight."""
    c = torch.cumsum(weights, -1)
    total = c[:, -1]
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        raise ValueError("sampling: a row has no token of finite positive probability")
    target = u * total.double()  # below the total, as u < 1
    t = target.to(c.dtype)  # rounded down where rounding went up, so it stays below the total too
    t = torch.where(t.double() > target, torch.nextafter(t, torch.zeros_like(t)), t)
    return torch.searchsorted(c, t[:, None], right=True).squeeze(1)
