"""Vocab-parallel embedding and LM head.

The vocabulary is padded to a multiple of the TP size and each rank holds one contiguous slice
of rows. Lookups of tokens outside the slice give zeros and an all-reduce assembles the rows;
the LM head scores the rank's slice and an all-gather builds the full logits. A tied LM head
reuses the embedding's slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.distributed.communicator import Communicator
from shardserve.layers.linear import apply_linear, copy_into, make_param, pack_weight
from shardserve.loader.source import TensorSource


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, comm: Communicator, dtype, device):
        super().__init__()
        self.vocab, self.comm = vocab, comm
        per_rank = -(-vocab // comm.size)
        self.start = per_rank * comm.rank
        self.end = self.start + per_rank
        self.weight = make_param((per_rank, hidden), dtype, device, self._load, [None])

    def _load(self, param: nn.Parameter, src: TensorSource, shard_id=None) -> None:
        real_end = min(self.end, self.vocab)
        param.data.zero_()  # padding rows stay zero
        if real_end > self.start:
            copy_into(param.data[: real_end - self.start], src.read(0, self.start, real_end), src.name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.start) & (ids < self.end)
        out = F.embedding((ids - self.start).clamp(0, self.end - self.start - 1), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.comm.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Scores hidden states against this rank's vocab slice, gathers, trims the padding."""

    def __init__(self, vocab: int, hidden: int, comm: Communicator, dtype, device,
                 tied_to: VocabParallelEmbedding | None = None):
        super().__init__(vocab, hidden, comm, dtype, device)
        self.tied = tied_to is not None
        if self.tied:
            self.weight = tied_to.weight
        self.packed: torch.Tensor | None = None

    def process_after_loading(self) -> None:
        self.packed = pack_weight(self.weight)
        if self.packed is not None and not self.tied:  # a tied embedding still looks rows up in it
            self.weight = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = apply_linear(hidden, self.weight, self.packed)
        logits = self.comm.all_gather(logits, dim=-1)
        return logits[:, : self.vocab]
