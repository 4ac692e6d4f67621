"""Test helpers that look inside one in-process engine."""

from __future__ import annotations

import torch

SMOLLM2_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def record_logits(core) -> dict[str, list[torch.Tensor]]:
    """From now on, every sampled row's logits by request id, in step order (the sampling
    rank's view, before penalties and temperature)."""
    seen: dict[str, list[torch.Tensor]] = {}
    sample = core.worker._sample

    def recording(plan, logits):
        rids = [e.rid for e in plan.entries if e.sample]
        for row, rid in zip(logits, rids):
            seen.setdefault(rid, []).append(row.clone())
        return sample(plan, logits)

    core.worker._sample = recording
    return seen
