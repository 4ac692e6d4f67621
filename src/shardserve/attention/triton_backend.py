"""The Triton backend: decodes and prefill chunks both read K/V in place from the pool through
block tables (attention/triton_kernels.py); nothing is gathered, no mask is built on the host.

The step's new K/V are written first, so a chunk's own keys and its cached prefix are read alike.
The kernels module is passed in by attention/select.py, which decides whether it runs compiled
(a GPU) or under Triton's interpreter (CPU tensors: tests).
"""

from __future__ import annotations

from types import ModuleType

import torch

from shardserve.attention.backend import AttentionBackend, Heads, begin
from shardserve.attention.metadata import AttentionMetadata, build_metadata


class TritonBackend(AttentionBackend):
    name = "triton"

    windows = False  # its decode and extend kernels attend to whole contexts

    def __init__(self, kernels: ModuleType, interpreted: bool):
        self.k, self.interpreted = kernels, interpreted

    def prepare(self, page_size, decodes, prefills, device, window=None, horizons=None) -> AttentionMetadata:
        assert window is None, "the model runner refuses a sliding window on this backend"
        return build_metadata(page_size, decodes, prefills, device, paged_decode=True, extend=True,
                              horizons=horizons)  # (refused where set: scheduler/limits.images_refused)

    def forward(self, heads: Heads, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        out = begin(q, k, v, k_cache, v_cache, meta)
        n = meta.num_decode
        if meta.paged is not None:
            p = meta.paged
            self.k.paged_decode(q[:n], k_cache, v_cache, p.block_tables, p.context_lens, heads.kv_index, heads.group,
                                meta.page_size, heads.scale, self.k.decode_splits(p.max_len), out=out[:n])
        if meta.extend is not None:
            e = meta.extend
            self.k.paged_extend(q[n:], k_cache, v_cache, e.block_tables, e.q_starts, e.kv_lens, heads.kv_index,
                                e.max_q, meta.page_size, heads.scale, out[n:])
        return out

    def decode_lse(self, heads: Heads, q, k_cache, v_cache, block_tables, context_lens, max_len,
                   page_size) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        q = q if q.stride(2) == 1 else q.contiguous()
        out = self.k.paged_decode(q, k_cache, v_cache, block_tables, context_lens, heads.kv_index, heads.group,
                                  page_size, heads.scale, self.k.decode_splits(max(max_len, 1)), lse=lse)
        return out, lse

    def describe(self) -> str:
        return "triton (interpreted on the CPU)" if self.interpreted else "triton"
