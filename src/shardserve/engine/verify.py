"""Speculative decoding on the sampling rank: check a request's K proposals against the target's
K+1 rows of logits, and say which tokens it emits.

Row j of the target's logits is its distribution for the token after proposal j-1 (row 0: after
the request's last known token). The rows are taken one at a time, each exactly as the sampler
would take that row had the tokens before it come one step at a time: bans, logit_bias and
penalties see the proposals accepted so far, the grammar mask is the matcher's after consuming
them, and the request's own generator draws. That is what makes greedy outputs equal to
non-speculative ones, and sampled outputs follow the target's distribution:

- greedy: accept proposal j while it is the row's argmax; the first row where it is not emits
  its argmax instead.
- sampled (Leviathan et al., Chen et al.): accept proposal d with probability min(1, p(d)/q(d)),
  p the target's filtered distribution and q the proposer's (a one-hot for n-gram lookup, whose
  proposal is certain); on rejection draw from norm(max(0, p - q)) and stop. When all K are
  accepted, the last row gives one more token (the bonus).

Logprobs are the target's raw ones at each emitted token, as without speculation.
"""

from __future__ import annotations

import torch

from shardserve.core import Request
from shardserve.engine.grammar import Guide
from shardserve.engine.sampler import Sampler, filter_logits, row_argmax, top_logprobs


def verify(logits: torch.Tensor, req: Request, proposal: list[int], q: torch.Tensor | None, sampler: Sampler,
           guide: Guide | None) -> tuple[list[int], list[dict | None], bool]:
    """`logits`: [len(proposal) + 1, vocab]; `q`: [len(proposal), vocab] (None: one-hot proposals).
    Returns the emitted tokens (the accepted proposals, then the target's own), their logprobs,
    and whether the request's grammar is complete after the last of them. The tokens are appended
    to `req` (the sampling rank's copy) as they are decided."""
    p = req.params
    tokens: list[int] = []
    lps: list[dict | None] = []
    for j in range(len(proposal) + 1):
        row = logits[j : j + 1].float()
        raw = torch.log_softmax(row[0], -1) if p.logprobs is not None else None
        if req.matcher is not None:
            row = guide.mask(row, [req])
        row = sampler.adjust(row[0], req)
        draft = proposal[j] if j < len(proposal) else None
        tok = _decide(row, p, draft, None if q is None or draft is None else q[j], req.generator)
        tokens.append(tok)
        lps.append(top_logprobs(raw, tok, p.logprobs) if raw is not None else None)
        req.append_token(tok)
        if req.matcher is not None and guide.accept([req], [tok]):
            return tokens, lps, True
        if tok != draft:
            break
    return tokens, lps, False


def _decide(row: torch.Tensor, p, draft: int | None, q: torch.Tensor | None, gen: torch.Generator | None) -> int:
    """The token this row emits: the proposal if accepted, else the target's own draw."""
    if p.greedy:
        return row_argmax(row[None])[0]
    probs = filter_logits(row, p).softmax(-1)
    if draft is None:  # every proposal accepted: the bonus token
        return int(torch.multinomial(probs, 1, generator=gen))
    q_d = float(q[draft]) if q is not None else 1.0
    u = float(torch.rand(1, generator=gen, device=probs.device))
    if u * q_d < float(probs[draft]):
        return draft
    if q is None:
        residual = probs.clone()
        residual[draft] = 0.0
    else:
        residual = (probs - q.to(probs.dtype)).clamp_(min=0.0)
    if float(residual.sum()) <= 0.0:  # p == q: a rejection is (almost) impossible; draw from p
        residual = probs
    return int(torch.multinomial(residual, 1, generator=gen))
