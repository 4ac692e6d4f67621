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
from shardserve.layers import quant_kernel
from shardserve.layers.linear import apply_linear, copy_into, make_param, pack_weight
from shardserve.loader.quantized import QuantWeight
from shardserve.loader.source import TensorSource


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, comm: Communicator, dtype, device):
        super().__init__()
        self.vocab, self.comm = vocab, comm
        per_rank = -(-vocab // comm.size)
        self.start = per_rank * comm.rank
        self.end = self.start + per_rank
        self.weight = make_param((per_rank, hidden), dtype, device, self._load, [None])
        # The rows as the checkpoint's blocks (a GGUF's token_embd under --quantization auto):
        # looked up by expanding just the rows asked for. Padding rows are not stored.
        self.quant: QuantWeight | None = None

    def _load(self, param: nn.Parameter, src: TensorSource, shard_id=None) -> None:
        real_end = min(self.end, self.vocab)
        if real_end > self.start and (q := src.read_quantized(0, self.start, real_end)) is not None:
            self.quant = q
            return
        param.data.zero_()  # padding rows stay zero
        if real_end > self.start:
            copy_into(param.data[: real_end - self.start], src.read(0, self.start, real_end), src.name)

    def process_after_loading(self) -> None:
        if self.quant is not None:
            self.quant = quant_kernel.kernel_layout(self.quant)  # a tied LM head multiplies it too
            self.weight = None

    def _rows(self, local: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return F.embedding(local, self.weight)
        flat = local.reshape(-1).clamp(0, self.quant.rows - 1)
        return quant_kernel.dequantize(self.quant, flat).reshape(*local.shape, -1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return self._rows(ids)
        held = self.quant.rows if self.quant is not None else self.end - self.start
        inside = (ids >= self.start) & (ids < self.start + held)
        out = self._rows((ids - self.start).clamp(0, held - 1))
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.comm.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Scores hidden states against this rank's vocab slice, gathers, trims the padding."""

    def __init__(self, vocab: int, hidden: int, comm: Communicator, dtype, device,
                 tied_to: VocabParallelEmbedding | None = None):
        super().__init__(vocab, hidden, comm, dtype, device)
        # A tuple, so the embedding is not registered (and loaded) twice as a submodule.
        self._tied_to = (tied_to,) if tied_to is not None else ()
        if tied_to is not None:
            self.weight = tied_to.weight
        self.packed: torch.Tensor | None = None

    def process_after_loading(self) -> None:
        if self._tied_to:  # one copy for both, in the kernels' layout whichever is processed first
            emb = self._tied_to[0]
            if emb.quant is not None:
                emb.quant = quant_kernel.kernel_layout(emb.quant)
            self.quant = emb.quant
        elif self.quant is not None:
            self.quant = quant_kernel.kernel_layout(self.quant)
        if self.quant is None:  # float32 on the CPU: F32 rows in the kernels' layout
            self.quant = quant_kernel.float_weight(self.weight)
            if self.quant is not None and self._tied_to:  # the embedding looks its rows up there: one copy
                self._tied_to[0].quant, self._tied_to[0].weight = self.quant, None
        if self.quant is not None:
            self.weight = None
            return
        self.packed = pack_weight(self.weight)
        if self.packed is not None and not self._tied_to:  # a tied embedding still looks rows up in it
            self.weight = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            logits = quant_kernel.linear(hidden, ((0, self.quant),), self.quant.rows)
            if logits.shape[-1] < self.end - self.start:  # the last rank's padding rows score 0
                logits = F.pad(logits, (0, self.end - self.start - logits.shape[-1]))
        else:
            logits = apply_linear(hidden, self.weight, self.packed)
        logits = self.comm.all_gather(logits, dim=-1)
        return logits[:, : self.vocab]
