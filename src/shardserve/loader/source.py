"""A tensor in a checkpoint that has not been read yet.

Layers' loader hooks call `read(dim, start, end)` for just the rows or columns they own, so a
safetensors file is sliced on read and no rank holds a full copy of a tensor it shards.
`Int8Source` (`--quantization int8`) quantizes just that slice to Q8_0 blocks; `Bf16Source`
(`--dtype bfloat16` on the CPU) hands it out as bfloat16 rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    # Sources sit above the block formats (they hand out QuantWeights); the formats know
    # nothing of sources.
    from shardserve.loader.quantized import QuantWeight


class TensorSource:
    """Base: a named tensor with a shape that can be read whole or as one slice along a dim."""

    name: str

    @property
    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def read_quantized(self, dim: int | None = None, start: int = 0, end: int | None = None) -> QuantWeight | None:
        """The same slice in a block-quantized format, where this source keeps one and the cut
        falls on block boundaries; None means: read floats."""
        return None

    def release(self) -> None:
        """Drop what reading kept (the loader calls it once a tensor's layers have their pieces,
        which they copied or still reference): the list of sources then holds no tensor."""


class SliceSource(TensorSource):
    """A safetensors entry opened with `safe_open(...).get_slice(name)`: reads only the slice."""

    def __init__(self, name: str, handle: Any):
        self.name, self._slice = name, handle

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._slice.get_shape())

    def read(self, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        if dim is None:
            return self._slice[:]
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, end)
        return self._slice[tuple(index)]


class LazySource(TensorSource):
    """A tensor produced by a function (e.g. a GGUF dequantisation), computed once, then sliced.
    `quantized`, where given, yields the tensor still in its block format (or None); a layer
    that takes that form never triggers the float one."""

    def __init__(self, name: str, load: Callable[[], torch.Tensor],
                 quantized: Callable[[], QuantWeight | None] | None = None, shape: tuple[int, ...] | None = None):
        """`shape`, where the caller knows it (a GGUF's header does), answers `.shape` without
        computing the tensor: asking a quantized weight's shape must not expand it."""
        self.name, self._load, self._t = name, load, None
        self._quantized, self._q, self._shape = quantized, None, shape

    def _tensor(self) -> torch.Tensor:
        if self._t is None:
            self._t = self._load()
        return self._t

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape if self._shape is not None else tuple(self._tensor().shape)

    def release(self) -> None:
        self._t = self._q = None

    def read(self, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        t = self._tensor()
        return t if dim is None else t.narrow(dim, start, (end or t.shape[dim]) - start)

    def read_quantized(self, dim: int | None = None, start: int = 0, end: int | None = None) -> QuantWeight | None:
        if self._quantized is None:
            return None
        if self._q is None:
            self._q = self._quantized()
            if self._q is None:
                self._quantized = None
                return None
        return self._q.narrow(dim, start, end)


class ConvertingSource(TensorSource):
    """A float checkpoint tensor read as it is, which a layer may also take converted (the
    subclass's `read_quantized`): only the slice the layer asks for is read and converted."""

    def __init__(self, src: TensorSource):
        self.src, self.name = src, src.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.src.shape

    def read(self, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        return self.src.read(dim, start, end)

    def release(self) -> None:
        self.src.release()


class Int8Source(ConvertingSource):
    """Offers 2-D slices as Q8_0 blocks (`--quantization int8`) where the cut keeps whole blocks."""

    def read_quantized(self, dim: int | None = None, start: int = 0, end: int | None = None) -> QuantWeight | None:
        if len(self.src.shape) != 2 or (dim == 1 and (start % 32 or (end or self.shape[1]) % 32)):
            return None
        # Imported here: this module stays free of torch for the API server, which reads configs only.
        from shardserve.loader.quantized import quantize_q8_0

        return quantize_q8_0(self.src.read(dim, start, end))


class Bf16Source(ConvertingSource):
    """Offers 2-D slices as bfloat16 rows (BF16, for the C kernels: `--dtype bfloat16` on the CPU);
    1-D tensors (norms, biases) are read as floats."""

    def read_quantized(self, dim: int | None = None, start: int = 0, end: int | None = None) -> QuantWeight | None:
        if len(self.src.shape) != 2:
            return None
        from shardserve.loader.quantized import bf16_rows

        return bf16_rows(self.src.read(dim, start, end))


class RowsSource(TensorSource):
    """Rows [offset, offset + rows) of another source, under a name of their own: one piece of a
    tensor a checkpoint stores fused (Phi-3's qkv_proj and gate_up_proj), so it loads through
    the same hooks as the separate tensors other checkpoints store. Reads only those rows."""

    def __init__(self, name: str, src: TensorSource, offset: int, rows: int):
        self.name, self.src, self.offset, self.rows = name, src, offset, rows

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *self.src.shape[1:])

    def _span(self, dim: int | None, start: int, end: int | None) -> tuple[int, int]:
        if dim != 0:
            return self.offset, self.offset + self.rows
        return self.offset + start, self.offset + (self.rows if end is None else end)

    def read(self, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        t = self.src.read(0, *self._span(dim, start, end))
        return t if dim in (None, 0) else t.narrow(dim, start, (end or t.shape[dim]) - start)

    def read_quantized(self, dim: int | None = None, start: int = 0, end: int | None = None) -> QuantWeight | None:
        q = self.src.read_quantized(0, *self._span(dim, start, end))
        return q if q is None or dim in (None, 0) else q.narrow(dim, start, end)
