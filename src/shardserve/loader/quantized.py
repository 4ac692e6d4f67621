"""Block-quantized weights as they sit in a GGUF file, and int8 quantization of float weights.

A `QuantWeight` is a 2-D weight [rows, cols] kept in one of llama.cpp's block formats: each row
is `cols / block` blocks of `block_bytes` bytes, stored as a uint8 tensor [rows, row_bytes].
Plain float32 rows (F32, GGML's type 0: one weight per "block") and bfloat16 rows (BF16, type
30) take the same form, so a float checkpoint runs on the same C kernels and decode loop
(`float_rows`, `bf16_rows`).
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
BF16 = 30
# A flag on Q4_0, Q4_1, Q8_0, F32 and BF16: the same bytes with each group of 16 rows
# interleaved, the layout the C kernels multiply at every batch size (layers/csrc/quant_x16.c;
# `interleave16`).
X16 = 0x100
X16_FORMATS = (2, 3, 8, F32, BF16)
# Plain float rows: one weight per "block", of this many bytes.
FLOAT_ROWS = {F32: 4, BF16: 2}
# Every layout a QuantWeight holds: the block formats, plain float rows, and their x16 layouts.
_BASE: dict[int, tuple[str, int, int]] = {**FORMATS, F32: ("F32", 1, 4), BF16: ("BF16", 1, 2)}
LAYOUTS: dict[int, tuple[str, int, int]] = {
    **_BASE, **{X16 | t: (_BASE[t][0] + "x16", *_BASE[t][1:]) for t in X16_FORMATS}}
GROUP = 16


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
        if self.qtype & X16:
            raise ValueError(f"{self.name}: an interleaved weight is not cut; cut it before interleave16")
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
        if self.qtype == BF16:
            return self.data.view(torch.bfloat16).float()
        if self.qtype & X16:
            return deinterleave16(self).dequantize()
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        out = dequantize(self.data.cpu().numpy(), GGMLQuantizationType(self.qtype))
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(self.shape)


def float_rows(weight: torch.Tensor) -> QuantWeight:
    """A float32 [rows, cols] weight as F32 rows (the same memory, viewed as bytes)."""
    return QuantWeight(F32, weight.detach().contiguous().view(torch.uint8), weight.shape[1])


def bf16_rows(weight: torch.Tensor) -> QuantWeight | None:
    """A float [rows, cols] weight as BF16 rows (rounded to nearest even where it is not bfloat16
    already, as torch's `.to(torch.bfloat16)` does), or None where the columns are odd (the
    kernels take them in pairs)."""
    if weight.dim() != 2 or weight.shape[1] % 2:
        return None
    w = weight.detach().to(torch.bfloat16).contiguous()
    return QuantWeight(BF16, w.view(torch.uint8), weight.shape[1])


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



# ---------------------------------------------------------------- the x16 layout

def _to_x16(qtype: int, blocks: np.ndarray) -> np.ndarray:
    """[G, L, nb, bytes] blocks of groups of L rows -> [G, nb, L * bytes]: per block the rows'
    scales, minimums (Q4_1), then chunks of two columns (8-bit) or four (4-bit) for all L rows."""
    heads = [blocks[..., 0:2], *([blocks[..., 2:4]] if qtype == 3 else [])]
    qs = blocks[..., 2 * len(heads):]
    if qtype == 8:  # chunk p, byte 2j + s: row j's column 2p + s
        q = qs.reshape(*qs.shape[:-1], 16, 2)
    else:  # chunk c, byte 2j + s: column 4c + s in the low nibble, 4c + 2 + s in the high
        vals = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(*qs.shape[:-1], 8, 2, 2)
        q = vals[..., 0, :] | (vals[..., 1, :] << 4)
    g, lanes, nb = blocks.shape[:3]
    parts = [np.moveaxis(h, 1, 2).reshape(g, nb, -1) for h in heads]  # [G, nb, L, 2]
    parts.append(np.moveaxis(q, 1, 3).reshape(g, nb, -1))  # [G, nb, chunks, L, 2]
    return np.concatenate(parts, axis=-1)


def _from_x16(qtype: int, grouped: np.ndarray, lanes: int) -> np.ndarray:
    """The inverse of _to_x16: [G, nb, L * bytes] -> [G, L, nb, bytes]."""
    g, nb, _ = grouped.shape
    nheads = 2 if qtype == 3 else 1
    heads = [np.moveaxis(grouped[..., 2 * lanes * i: 2 * lanes * (i + 1)].reshape(g, nb, lanes, 2), 2, 1)
             for i in range(nheads)]
    chunks = grouped[..., 2 * lanes * nheads:].reshape(g, nb, -1, lanes, 2)
    q = np.moveaxis(chunks, 3, 1)  # [G, L, nb, chunks, 2]
    if qtype == 8:
        qs = q.reshape(g, lanes, nb, 32)
    else:
        vals = np.stack([q & 0xF, q >> 4], axis=-2).reshape(g, lanes, nb, 32)
        qs = vals[..., :16] | (vals[..., 16:] << 4)
    return np.concatenate([*heads, qs], axis=-1)


def _regroup(q: QuantWeight, qtype: int, forward: bool) -> np.ndarray:
    """q's bytes with every group of 16 rows (the last: rows % 16) converted to or from x16."""
    _, block, bb = _BASE[qtype]
    rows, nb = q.rows, q.cols // block
    src = q.data.cpu().numpy().reshape(rows, nb * bb)
    out = np.empty_like(src)
    full = rows // GROUP * GROUP
    for g0, g1, lanes in ((0, full, GROUP), (full, rows, rows - full)):
        if g1 > g0:
            if qtype in FLOAT_ROWS:  # column by column: [cols][L] floats, [cols / 2][L][2] bfloat16
                per = 4 // FLOAT_ROWS[qtype]  # columns a lane holds together: 1, or a pair
                shape = (-1, lanes, q.cols // per, 4) if forward else (-1, q.cols // per, lanes, 4)
                res = np.swapaxes(src[g0:g1].reshape(shape), 1, 2)
            elif forward:
                res = _to_x16(qtype, src[g0:g1].reshape(-1, lanes, nb, bb))
            else:
                res = _from_x16(qtype, src[g0:g1].reshape(-1, nb, lanes * bb), lanes)
            out[g0:g1] = res.reshape(g1 - g0, nb * bb)
    return out


def interleave16(q: QuantWeight) -> QuantWeight:
    """Q4_0, Q4_1, Q8_0, F32 or BF16 rows in the x16 layout (quant_x16.c states it): the same
    bytes, each group of 16 rows stored block by block (F32: column by column, BF16: by pairs of
    columns) so that one vector load holds a column (a pair) of 16 rows."""
    if q.qtype not in X16_FORMATS:
        raise ValueError(f"{q.name}: no x16 layout")
    return QuantWeight(X16 | q.qtype, torch.from_numpy(_regroup(q, q.qtype, True)).to(q.data.device), q.cols)


def deinterleave16(q: QuantWeight) -> QuantWeight:
    """The rows back in their base format (references and tests; the kernels read x16 in place)."""
    base = q.qtype & ~X16
    return QuantWeight(base, torch.from_numpy(_regroup(q, base, False)).to(q.data.device), q.cols)
