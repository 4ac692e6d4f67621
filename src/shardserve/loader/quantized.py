"""Block-quantized weights as they sit in a GGUF file, and int8 quantization of float weights.

A `QuantWeight` is a 2-D weight [rows, cols] kept in one of llama.cpp's block formats: each row
is `cols / block` blocks of `block_bytes` bytes, stored as a uint8 tensor [rows, row_bytes].
Plain float32 rows (F32, GGML's type 0: one weight per "block") take the same form, so a float
checkpoint runs on the same C kernels and decode loop (`float_rows`).
Rows slice freely (a column-parallel or vocab-parallel shard); columns slice only on block
boundaries (a row-parallel shard), so `narrow` answers None where a cut falls inside a block
and the caller keeps that shard in floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# GGML type id -> (name, weights per block, bytes per block). The formats with a kernel.
FORMATS: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    14: ("Q6_K", 256, 210),
}
Q8_0 = 8
F32 = 0
# Every layout a QuantWeight holds: the block formats and plain float32 rows.
LAYOUTS: dict[int, tuple[str, int, int]] = {**FORMATS, F32: ("F32", 1, 4)}


@dataclass(frozen=True)
class QuantWeight:
    qtype: int
    data: torch.Tensor  # uint8 [rows, row_bytes]
    cols: int

    def __post_init__(self) -> None:
        _, block, nbytes = LAYOUTS[self.qtype]
        if self.cols % block or self.data.shape[-1] != self.cols // block * nbytes:
            raise ValueError(f"{self.name}: {self.cols} columns are not whole {block}-weight blocks "
                             f"of {tuple(self.data.shape)} bytes")

    @property
    def name(self) -> str:
        return LAYOUTS[self.qtype][0]

    @property
    def block(self) -> int:
        return LAYOUTS[self.qtype][1]

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def narrow(self, dim: int | None, start: int = 0, end: int | None = None) -> QuantWeight | None:
        """Rows [start, end) (dim 0) or columns (dim 1); None if a column cut splits a block."""
        if dim is None:
            return self
        end = self.shape[dim] if end is None else end
        if dim == 0:
            return QuantWeight(self.qtype, self.data[start:end], self.cols)
        if start % self.block or end % self.block:
            return None
        per = LAYOUTS[self.qtype][2]
        return QuantWeight(self.qtype, self.data[:, start // self.block * per: end // self.block * per],
                           end - start)

    def to(self, device: torch.device) -> QuantWeight:
        return QuantWeight(self.qtype, self.data.to(device).contiguous(), self.cols)

    def dequantize(self) -> torch.Tensor:
        """Float32 [rows, cols] by gguf's own (numpy) decoder: the reference the kernels match."""
        if self.qtype == F32:
            return self.data.view(torch.float32).clone()
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        out = dequantize(self.data.cpu().numpy(), GGMLQuantizationType(self.qtype))
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(self.shape)


def float_rows(weight: torch.Tensor) -> QuantWeight:
    """A float32 [rows, cols] weight as F32 rows (the same memory, viewed as bytes)."""
    return QuantWeight(F32, weight.detach().contiguous().view(torch.uint8), weight.shape[1])


def quantize_q8_0(weight: torch.Tensor) -> QuantWeight | None:
    """A float [rows, cols] weight as Q8_0 blocks (f16 scale = max|w| / 127, then 32 int8), or
    None where the columns are not whole blocks of 32."""
    if weight.dim() != 2 or weight.shape[1] % 32:
        return None
    rows, cols = weight.shape
    w = weight.detach().float().reshape(rows, cols // 32, 32)
    d = (w.abs().amax(dim=-1, keepdim=True) / 127.0).half()
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = (w * inv).round().clamp(-127, 127).to(torch.int8)
    blocks = torch.cat([d.view(torch.uint8).reshape(rows, cols // 32, 2), q.view(torch.uint8)], dim=-1)
    return QuantWeight(Q8_0, blocks.reshape(rows, -1).contiguous(), cols)

