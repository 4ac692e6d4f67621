"""The CPU backend: decodes (and, batch-invariant, prefill tokens) through the C kernel that reads
the pages in place (attention/cpu_kernel.py); other prefill chunks by SDPA as the torch backend."""

from __future__ import annotations

import torch

from shardserve.attention import cpu_kernel
from shardserve.attention.backend import Heads, begin
from shardserve.attention.metadata import AttentionMetadata, build_metadata
from shardserve.attention.torch_backend import TorchBackend


class CpuBackend(TorchBackend):
    """`batch_invariant`: every prefill token attends as a decode does (see attention/metadata.py)."""

    name = "cpu"

    def __init__(self, batch_invariant: bool):
        self.batch_invariant = batch_invariant

    def prepare(self, page_size, decodes, prefills, device, window=None, horizons=None) -> AttentionMetadata:
        return build_metadata(page_size, decodes, prefills, device, paged_decode=True,
                              paged_prefill=self.batch_invariant, window=window, horizons=horizons)

    def forward(self, heads: Heads, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        out = begin(q, k, v, k_cache, v_cache, meta)
        n = meta.num_decode
        if meta.paged is not None:
            p = meta.paged
            cpu_kernel.paged_decode(q[:n], k_cache, v_cache, p.block_tables, p.context_lens, heads.kv_index,
                                    meta.page_size, heads.scale, out=out[:n], skips=p.skips, softcap=heads.softcap)
        if meta.paged_prefill is not None:
            p = meta.paged_prefill
            cpu_kernel.paged_decode(q[n:], k_cache, v_cache, p.block_tables, p.context_lens, heads.kv_index,
                                    meta.page_size, heads.scale, out=out[n:], skips=p.skips, softcap=heads.softcap)
        else:
            self._prefills(heads, q, k, v, k_cache, v_cache, meta, out)
        return out

    def sdpa_prefills(self, meta: AttentionMetadata) -> bool:
        return bool(meta.prefills) and meta.paged_prefill is None

    def decode_lse(self, heads: Heads, q, k_cache, v_cache, block_tables, context_lens, max_len,
                   page_size) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        out = cpu_kernel.paged_decode(q, k_cache, v_cache, block_tables, context_lens, heads.kv_index, page_size,
                                      heads.scale, lse=lse, softcap=heads.softcap)
        return out, lse

    def describe(self) -> str:
        return "cpu (prefill too: batch-invariant)" if self.batch_invariant else "cpu"
