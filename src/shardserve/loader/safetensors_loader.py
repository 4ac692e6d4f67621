"""Stream the tensors of a Hugging Face checkpoint directory, one at a time, sliced on read."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

from safetensors import safe_open

from shardserve.loader.source import SliceSource


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def count_tensors(path: str) -> int:
    total = 0
    for file in safetensors_files(path):
        with safe_open(file, "pt") as f:
            total += len(f.keys())
    return total


def iter_safetensors(path: str) -> Iterator[SliceSource]:
    """Yield a SliceSource per tensor; nothing is read until the layer's hook asks for a slice."""
    for file in safetensors_files(path):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                yield SliceSource(name, f.get_slice(name))
