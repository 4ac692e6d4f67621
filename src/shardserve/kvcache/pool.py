"""The paged KV pool: per layer, one K and one V tensor of `num_pages * page_size` slots.

K and V may differ in width (ModelConfig.kv_widths): latent attention caches one vector per
token in K and leaves V empty (zero wide: it costs nothing and ships nothing)."""

from __future__ import annotations

import torch


class KVPool:
    """Slot `p * page_size + i` holds token i of page p. Layers get [slots, kv_heads, width] views."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 widths: tuple[int, int], dtype: torch.dtype, device: torch.device):
        self.num_pages, self.page_size = num_pages, page_size
        slots = num_pages * page_size
        # empty, not zeros: untouched pages cost no resident memory on CPU.
        self.k = torch.empty((num_layers, slots, num_kv_heads, widths[0]), dtype=dtype, device=device)
        self.v = torch.empty((num_layers, slots, num_kv_heads, widths[1]), dtype=dtype, device=device)

    def layer_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.k[i], self.v[i]) for i in range(self.k.shape[0])]
