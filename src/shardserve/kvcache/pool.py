"""The paged KV pool: per layer, one K and one V tensor of `num_pages * page_size` slots."""

from __future__ import annotations

import torch


def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one page costs across all layers, K and V."""
    return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class KVPool:
    """Slot `p * page_size + i` holds token i of page p. Layers get [slots, kv_heads, dim] views."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_pages, self.page_size = num_pages, page_size
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        # empty, not zeros: untouched pages cost no resident memory on CPU.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)

    def layer_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.k[i], self.v[i]) for i in range(self.k.shape[0])]
