"""Rows of a step that the sampling rank treats apart: an embedding request's pooled rows, and a
request whose logits are not finite (which then fails alone)."""

from __future__ import annotations

import numpy as np
import torch

from shardserve.core import Request
from shardserve.engine.model_runner import StepInputs
from shardserve.layers import cpu_ops


def pooled_rows(entries: list, sampling: dict[str, Request], step: StepInputs) -> list[tuple[Request, int, int]]:
    """Embedding requests' rows in this step: step.hidden_rows gets them; returns (request,
    first position, end position) per request, in row order. Positions pooled before a
    preemption are not pooled again."""
    out, offset = [], 0
    for e in entries:
        req, n = sampling.get(e.rid), len(e.token_ids)
        mode = req.params.pooling if req is not None else None
        size = len(req.prompt_token_ids) if req is not None else 0
        if mode == "mean":
            p0, p1 = max(e.start, req.pooled_upto), min(e.start + n, size)
        elif mode == "last" and req.pooled_upto < size <= e.start + n:
            p0, p1 = size - 1, size
        else:
            p0 = p1 = 0
        if p1 > p0:
            step.hidden_rows.extend(range(offset + p0 - e.start, offset + p1 - e.start))
            out.append((req, p0, p1))
        offset += n
    return out


def embeddings(pooled: list[tuple[Request, int, int]], hidden: torch.Tensor | None) -> dict[str, list[float]]:
    """Each pooled request's sum (mean pooling) or last row so far; the complete ones' embeddings."""
    done, row = {}, 0
    for req, p0, p1 in pooled:
        rows = hidden[row : row + p1 - p0]
        row += p1 - p0
        mean = req.params.pooling == "mean"
        if mean:
            req.pool = rows.sum(0) if req.pool is None else req.pool + rows.sum(0)
        else:
            req.pool = rows[-1]
        req.pooled_upto = p1
        if p1 == len(req.prompt_token_ids):
            done[req.request_id] = (req.pool / p1 if mean else req.pool).tolist()
    return done


def finite_rows(logits: torch.Tensor, rows: int, sampled: list) -> tuple[torch.Tensor, dict[int, str]]:
    """A sampled entry whose logits are not all finite (an overflow in its rows, say) fails alone:
    (the logits with its rows zeroed, so the batch samples on; position among the sampled entries
    -> why). One check of the rows per step, on the sampling rank only."""
    # On the CPU one pass of the C kernel where it is built (AVX-512). Else a row is all finite
    # where its max and min are (NaN propagates through both): two row reductions cost a tenth of
    # an elementwise test; a few CPU rows in numpy, in the calling thread, where waking torch's
    # thread pool costs more than their reductions.
    head = logits[:rows]
    if (finite := cpu_ops.rows_finite(head)) is not None:
        bad = ~finite
    elif head.device.type == "cpu" and head.dtype == torch.float32 and rows < 8:
        a = head.numpy()
        bad = torch.from_numpy(~(np.isfinite(a.max(1)) & np.isfinite(a.min(1))))
    else:
        bad = ~(torch.isfinite(head.amax(dim=1)) & torch.isfinite(head.amin(dim=1)))
    if not bool(bad.any()):
        return logits, {}
    logits, failed, at = logits.clone(), {}, 0
    for k, e in enumerate(sampled):
        n = e.num_draft + 1
        if bool(bad[at : at + n].any()):
            failed[k] = "the model's logits for this request were not finite (NaN or infinity)"
            logits[at : at + n] = 0
        at += n
    return logits, failed
