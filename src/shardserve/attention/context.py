"""Attention under context parallelism: a request's KV spread page by page over N ranks' pools.

Each context rank runs the step's decodes whole (every rank has every decode's query, its KV
goes to the one rank whose page holds its position) and its own tokens of each prefill chunk
(those in its own pages, see kvcache/spread.py). Per layer:

- the rank writes the new K/V of the rows it stores (`write_rows`) into its pool;
- **decodes**: the rank attends each query to the keys in its own pages (the inner backend's
  `decode_lse`: the CPU C kernel, Triton's, or a padded gather, all returning the log-sum-exp;
  a rank holding none of a request's keys gives lse -inf), and `merge_across` combines the
  ranks' partials with one all-gather;
- **prefill chunks**: ring attention (attention/ring.py), each rank's block being every key of
  the request it holds through the chunk (older pages too, so a later chunk and a prefix-cache
  hit see their whole context wherever it lives), masked causally by position.

Which rows, slots and positions those are is the engine's business (engine/context_inputs.py);
what is built once per step is here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardserve.attention.backend import AttentionBackend, Heads, write_cache
from shardserve.attention.ring import merge_across, ring_attention
from shardserve.attention.torch_backend import gather
from shardserve.distributed.communicator import Communicator


@dataclass
class ContextChunk:
    """This rank's part of one prefill chunk: rows [start, start + q_len) at positions q_pos, and
    every key of the request this rank holds through the chunk (its cache slots and positions);
    `lengths`: every context rank's number of such keys."""

    start: int
    q_len: int
    q_pos: torch.Tensor
    kv_slots: torch.Tensor
    k_pos: torch.Tensor
    lengths: list[int]


@dataclass
class ContextMetadata:
    comm: Communicator  # the context group
    slot_mapping: torch.Tensor  # cache slots of the rows this rank stores
    write_rows: torch.Tensor | None  # which rows those are (None: every row)
    num_decode: int
    block_tables: torch.Tensor  # [decodes, pages] this rank's pages of each decode (unused entries 0)
    context_lens: torch.Tensor  # [decodes] keys this rank holds of each decode (0 allowed)
    max_len: int  # the largest of context_lens
    chunks: list[ContextChunk]
    page_size: int


class ContextBackend(AttentionBackend):
    """Attention under context parallelism, over `inner` for each rank's own part of a decode.
    Its metadata comes from the engine's context split (engine/context_inputs.py), not `prepare`."""

    name = "context"

    windows = False  # the ring and its decode merge attend to whole contexts

    def __init__(self, inner: AttentionBackend):
        self.inner = inner

    def prepare(self, page_size, decodes, prefills, device, window=None, horizons=None):
        raise NotImplementedError("context parallelism's metadata is built by engine/context_inputs.py")

    def forward(self, heads: Heads, q, k, v, k_cache, v_cache, meta: ContextMetadata) -> torch.Tensor:
        if meta.write_rows is not None:
            k, v = k.index_select(0, meta.write_rows), v.index_select(0, meta.write_rows)
        write_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        b = meta.num_decode
        if b:
            part, lse = self.inner.decode_lse(heads, q[:b], k_cache, v_cache, meta.block_tables, meta.context_lens,
                                              meta.max_len, meta.page_size)
            out[:b] = merge_across(meta.comm, part, lse)
        for c in meta.chunks:
            keys = gather(k_cache, c.kv_slots)
            values = keys if v_cache is k_cache else gather(v_cache, c.kv_slots)  # `is`: ships once
            o, _ = ring_attention(meta.comm, q[c.start : c.start + c.q_len], keys, values, c.q_pos, c.k_pos,
                                  heads.scale, heads.kv_index, c.lengths)
            out[c.start : c.start + c.q_len] = o
        return out

    def decode_lse(self, heads, q, k_cache, v_cache, block_tables, context_lens, max_len, page_size):
        return self.inner.decode_lse(heads, q, k_cache, v_cache, block_tables, context_lens, max_len, page_size)

    def describe(self) -> str:
        return f"{self.inner.name} decodes, ring attention prefills over the context group"
