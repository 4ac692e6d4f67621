"""The one attention interface: a backend, chosen once per model runner (attention/select.py),
that every layer calls with its own heads.

- `prepare(page_size, decodes, prefills, device)` builds the step's metadata once, in the form
  the backend's kernels read (attention/metadata.py);
- `forward(heads, q, k, v, k_cache, v_cache, meta)` writes the step's new K/V into the layer's
  pool views and returns the attention output;
- `decode_lse(...)` attends decode queries to a block table's keys and returns the log-sum-exp
  too: context parallelism (attention/context.py) composes over any backend through it.

Backends: "cpu" (the C kernel reads the pages in place), "torch" (gather + SDPA, any device),
"triton" (paged kernels on a GPU, or on CPU tensors under Triton's interpreter), and "context"
(wraps one of those under context parallelism). Layers never ask which one runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from shardserve.attention import cpu_kernel
from shardserve.attention.metadata import AttentionMetadata


class Heads:
    """One layer's local heads: query head h reads KV head `kv_of_q[h]` (uneven groups happen
    when tensor parallelism replicates a KV head, see HeadShard). `softcap` > 0: each scaled
    score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2's)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 kv_of_q: tuple[int, ...], device: torch.device | None = None, softcap: float = 0.0):
        self.h, self.hkv, self.d, self.scale, self.softcap = num_heads, num_kv_heads, head_dim, scale, softcap
        self.kv_index = torch.tensor(kv_of_q, dtype=torch.long, device=device)
        uniform = num_heads % num_kv_heads == 0 and kv_of_q == tuple(
            i // (num_heads // num_kv_heads) for i in range(num_heads))
        # Query heads that share a KV head side by side: SDPA's grouped mode, one K/V load per
        # group in a kernel. Otherwise each head looks its KV head up.
        self.group = num_heads // num_kv_heads if uniform else 1
        self.expand_index = None if uniform else self.kv_index

    def expand(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """K/V laid [..., heads, seq, dim]; returns them with a flag for SDPA's grouped mode."""
        if self.expand_index is not None:
            return k.index_select(-3, self.expand_index), v.index_select(-3, self.expand_index), False
        return k, v, self.hkv != self.h


class AttentionBackend(ABC):
    name: str

    # Whether this backend attends within a sliding window (prepare's `window`).
    windows = True

    @abstractmethod
    def prepare(self, page_size: int, decodes: list[tuple[list[int], int]],
                prefills: list[tuple[list[int], int, int]], device: torch.device,
                window: int | None = None, horizons: list[list[int] | None] | None = None) -> AttentionMetadata:
        """decodes: (pages, context length with the new token); prefills: (pages, chunk length,
        context length through the chunk); window: each token attends to its last `window` keys
        (ModelConfig.attention_window; only where `windows`); horizons: per prefill chunk, None or
        each token's context length as it attends (an image's tokens see the whole image)."""

    @abstractmethod
    def forward(self, heads: Heads, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta) -> torch.Tensor:
        """q: [T, H, d]; k, v: [T, Hkv, d]; caches: [slots, Hkv, d]. Returns [T, H, d]. One cache
        passed as both (latent attention: the values are the keys) is written and read once."""

    @abstractmethod
    def decode_lse(self, heads: Heads, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, context_lens: torch.Tensor, max_len: int,
                   page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row of q [B, H, d] over its block table's first context_lens[b] keys (0 allowed):
        (out [B, H, d], lse [B, H] float32, -inf where a row has no key)."""

    def sdpa_prefills(self, meta) -> bool:
        """Whether this step's prefill chunks run as SDPA calls over gathered K/V (latent attention
        then decompresses them rather than attend absorbed)."""
        return False

    def describe(self) -> str:
        return self.name


def write_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slots: torch.Tensor) -> None:
    """The new K/V into the pool, rounded (nearest even) where the cache is narrower (a bfloat16
    cache under float32 activations: see engine/model_runner.kv_cache_dtype)."""
    if not cpu_kernel.write_rows(k, k_cache, slots):
        k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    if v_cache is not k_cache and not cpu_kernel.write_rows(v, v_cache, slots):
        v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def begin(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          meta: AttentionMetadata) -> torch.Tensor:
    """A paged backend's first steps: the new K/V into the pool, and the output to fill."""
    write_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
