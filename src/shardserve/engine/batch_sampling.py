"""Drawing a step's sampled rows together: temperature, top-k, top-p and min-p as batched tensor
operations, then each row's token by inverting its distribution's CDF at one uniform number drawn
from the request's own generator (so a seeded request draws the same tokens whatever shares its
step: every operation below is one row's alone, and the candidate count is fixed, not the batch's).

Why not a row at a time: over a 49k vocabulary on the CPU one row's softmax, full sort (top-p) and
multinomial took 1 to 5 ms, so 64 sampled streams spent longer sampling than in the forward pass.

A truncating row (top-k or top-p) starts from its largest logits, sorted (STAGES: 64, then 1024
for the rows 64 did not decide), instead of a sort of the whole vocabulary. Its kept set is exact
there when the last candidate is itself dropped: top-k (a value threshold), top-p (the mass before
a token only grows down the order) and min-p (a fraction of the largest probability) then drop
everything after it too. A row neither stage decides (a flat distribution under top-p, top-k
above the last stage) takes the whole-row filters of `filter_logits`, with the same uniform
number. Which stage decides depends on the row alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardserve.core import SamplingParams

STAGES = (64, 1024)  # the sorted candidates a truncating row starts from, then those of a row 64 left open


def truncates(p: SamplingParams, vocab: int) -> bool:
    """Whether the row's kept set depends on the order of its logits (top-k or top-p)."""
    return 0 < p.top_k < vocab or p.top_p < 1.0


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                filter_row: Callable[[torch.Tensor, SamplingParams], torch.Tensor]) -> list[int]:
    """One token per row of `logits` [n, vocab] (float32, bans and penalties already applied),
    each row under its params (temperature > 0) and drawn with its generator. `filter_row(row,
    params)` is the whole-row reference (`sampler.filter_logits`), for the rows no stage decides."""
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
    for k in STAGES:
        if not todo:
            break
        tokens, exact = _candidate_rows(x[todo], [params[i] for i in todo], u[todo], min(k, vocab))
        decided = exact.tolist()
        picked[[i for i, d in zip(todo, decided) if d]] = tokens[exact]
        todo = [i for i, d in zip(todo, decided) if not d]
    for i in todo:  # flat rows: the whole-row filters
        probs = filter_row(logits[i], params[i]).softmax(-1)
        picked[i] = inverse_cdf(probs[None], u[i : i + 1])[0]
    return picked.tolist()


def _whole_rows(x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Rows with no truncation by order: exp(x - max), each a probability over the largest one,
    less min-p's tail (a probability under min_p times the largest), drawn from. Overwrites x."""
    e = x.sub_(x.amax(-1, keepdim=True)).exp_()
    min_p = torch.tensor([p.min_p for p in params], dtype=e.dtype, device=x.device)
    if bool((min_p > 0).any()):
        e = e * (e >= min_p[:, None])
    return inverse_cdf(e, u)


def _candidate_rows(x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor,
                    k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with top-k or top-p, from their k largest logits: (a token per row, whether the
    candidates decided it: the tokens of the other rows are not to be used)."""
    vocab, dev = x.shape[1], x.device
    vals, ids = torch.topk(x, k, dim=-1)  # sorted, largest first
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
    if not bool(has_k.all()):
        lse = torch.where(has_k, lse, torch.logsumexp(x, -1, keepdim=True))
    probs = torch.exp(masked - lse)
    keep &= probs.cumsum(-1) - probs < top_p[:, None]  # the token that crosses top_p is kept
    keep &= probs >= min_p[:, None] * probs[:, :1]
    # Decided where the last candidate is dropped, or has probability 0 (and so has every token
    # after it), and top-k's threshold lay among the candidates; or every token is a candidate.
    exact = ((~keep[:, -1] | (probs[:, -1] == 0)) & (top_k <= k)) | (k == vocab)
    # Drawn in vocabulary order, as the whole rows and the whole-row filters are: the same uniform
    # number picks the same token whichever path a row takes.
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
