"""A GGUF file's header (metadata and tensor table) read in one pass, tensors memory-mapped.

gguf-py's `GGUFReader` builds a numpy view for every part of every metadata value: on a
vocabulary of 49,152 tokens and as many merges that is ~2 s per process, paid by the API
process, each rank and the tokenizer. Here a string array is read with `struct` straight from
the mapped bytes and a numeric array is one `np.frombuffer`, so the same header takes tens of
milliseconds. Values come out as `ReaderField.contents()` gives them (Python scalars, str,
lists), and tensors as gguf's own `ReaderTensor`, so the loader reads either the same way.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor

MAGIC = 0x46554747  # "GGUF", little-endian
VERSIONS = (2, 3)
STRING, ARRAY = 8, 9
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
TYPED = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
         GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
         GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
         GGMLQuantizationType.I64: np.int64}  # what gguf exposes as typed arrays; the rest as bytes


@dataclass(frozen=True)
class GGUFHeader:
    fields: dict[str, Any]  # key -> value, as ReaderField.contents() gives it
    tensors: list[ReaderTensor]  # in file order, data memory-mapped


class _Cursor:
    """Reads little-endian values from the mapped bytes, naming the file where they run out."""

    def __init__(self, buf: memoryview, path: str):
        self.buf, self.path, self.at = buf, path, 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buf):
            raise ValueError(f"{self.path}: GGUF header ends early (byte {self.at} of {len(self.buf)})")
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += size
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.at + n > len(self.buf):
            raise ValueError(f"{self.path}: GGUF header ends early (a string of {n} bytes at byte {self.at})")
        text = bytes(self.buf[self.at:self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            return self.array()
        if vtype not in SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.at}")
        return self.unpack(SCALARS[vtype])

    def array(self) -> list:
        etype, n = self.unpack("<I"), self.unpack("<Q")
        if etype in SCALARS:  # one frombuffer for the whole array
            dtype = np.dtype(SCALARS[etype])
            end = self.at + n * dtype.itemsize
            if end > len(self.buf):
                raise ValueError(f"{self.path}: GGUF header ends early (an array of {n} at byte {self.at})")
            out = np.frombuffer(self.buf, dtype, n, self.at).tolist()
            self.at = end
            return out
        return [self.value(etype) for _ in range(n)]


def read_header(path: str) -> GGUFHeader:
    """Parse `path`'s header; ValueError naming the file for anything that is not a GGUF we read."""
    if os.path.getsize(path) == 0:  # np.memmap's own error would not name the file
        raise ValueError(f"{path}: not a GGUF file (empty)")
    data = np.memmap(path, mode="r")
    cur = _Cursor(memoryview(data), path)
    if cur.unpack("<I") != MAGIC:
        raise ValueError(f"{path}: not a GGUF file (bad magic)")
    version = cur.unpack("<I")
    if version not in VERSIONS:
        raise ValueError(f"{path}: GGUF version {version} is not read here (versions {VERSIONS}; "
                         "a big-endian file reads as a huge version)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        fields[key] = cur.value(cur.unpack("<I"))
    infos, names = [], set()
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.unpack("<I")
        if name in names:  # gguf-py refuses these too: a name would otherwise mean either tensor
            raise ValueError(f"{path}: tensor {name} appears twice")
        names.add(name)
        dims = [cur.unpack("<Q") for _ in range(n_dims)]
        infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    align = int(fields.get("general.alignment", 32))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"{path}: general.alignment {align} is not a power of two")
    start = -(-cur.at // align) * align
    return GGUFHeader(fields, [_tensor(data, start, info, path) for info in infos])


def _tensor(data: np.memmap, start: int, info: tuple, path: str) -> ReaderTensor:
    """One tensor as gguf-py exposes it: dims innermost first in `shape`, `data` in numpy order
    (block formats as bytes, the innermost dim counted in bytes)."""
    name, dims, raw_type, offset = info
    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise ValueError(f"{path}: tensor {name} has unknown type {raw_type}") from None
    n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_bytes = n_elems * type_size // block
    np_dims = tuple(reversed(dims))
    at = start + offset
    if at + n_bytes > len(data):
        raise ValueError(f"{path}: tensor {name} runs past the end of the file")
    if qtype in TYPED:
        array = np.ndarray(np_dims, TYPED[qtype], data, at)
    else:
        array = np.ndarray((*np_dims[:-1], np_dims[-1] // block * type_size), np.uint8, data, at)
    return ReaderTensor(name=name, tensor_type=qtype, shape=np.array(dims, dtype=np.uint64), n_elements=n_elems,
                        n_bytes=n_bytes, data_offset=at, data=array, field=None)
