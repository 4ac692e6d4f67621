"""Read GGUF checkpoints' tensors (llama.cpp's format) as Hugging Face tensors.

The engine's model code speaks Hugging Face names and layouts, so everything here translates:
`blk.N.attn_q.weight` becomes `model.layers.N.self_attn.q_proj.weight`, stacked MoE expert
tensors are split per expert, and llama's Q/K rows are un-permuted back to the HF rotary layout.
GGUF metadata keys become config.json keys in gguf_metadata.py; the tokenizer is gguf_tokenizer.py's.

Tensors are never loaded eagerly: `iter_gguf_tensors` yields a loader per tensor and the header
reader (gguf_header.py) memory-maps the file, so peak memory is one dequantized tensor at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize

from shardserve.loader.gguf_deepseek import CORRECTION_BIAS, DEEPSEEK2_LAYER_TENSORS, SPLIT_KV_B, merged_kv_b
from shardserve.loader.gguf_metadata import config_from_reader, open_header
from shardserve.loader.gguf_names import (
    GGUF_ARCH_LAYER_TENSOR_TO_HF,
    GGUF_GLOBAL_TENSOR_TO_HF,
    GGUF_LAYER_TENSOR_TO_HF,
    GGUF_NORM_SHIFT,
    GGUF_ROPE_FACTOR_TENSORS,
    GGUF_STACKED_EXPERT_TENSOR_TO_HF,
)
from shardserve.loader.quantized import FORMATS, QuantWeight
from shardserve.loader.source import LazySource

_LAYER_TENSOR_RE = re.compile(r"blk\.(?P<layer>\d+)\.(?P<stem>\w+)\.(?P<kind>weight|bias)")

TensorLoader = Callable[[], torch.Tensor]
LAYER_TENSORS = GGUF_LAYER_TENSOR_TO_HF | DEEPSEEK2_LAYER_TENSORS


# ----------------------------------------------------------------------------- tensors


def _dequantize_to_torch(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Dequantize raw GGUF data (already in torch dim order) to a fresh float32 tensor."""
    if data.dtype == np.uint8:
        # Block-quantized (and BF16) data is exposed as bytes; gguf knows the block layouts.
        array = dequantize(data, qtype)
    else:
        array = data  # F32/F16/F64/I* are exposed as typed arrays already.
    # Copy out of the read-only memory map so callers own (and may mutate) the result.
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True))


def _unpermute_llama_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation for its rotary layout.

    llama.cpp's converter regroups each head's rows from HF's "first half / second half"
    rotary layout to interleaved pairs: reshape(n_heads, 2, d/2, ...).swapaxes(1, 2).
    The inverse views rows as (n_heads, d/2, 2, ...) and swaps those two axes back.
    Works for both weights (2-D) and biases (1-D).
    """
    half_head_dim = weight.shape[0] // n_heads // 2
    rows = weight.reshape(n_heads, half_head_dim, 2, *weight.shape[1:])
    return rows.transpose(1, 2).reshape(weight.shape).contiguous()


def _llama_rope_heads(config: dict, stem: str) -> int | None:
    """Head count whose rows to un-permute for this llama tensor, or None if not Q/K."""
    if config["model_type"] not in ("llama", "mixtral"):  # the ones llama.cpp converts as llama
        return None
    if stem == "attn_q":
        return config["num_attention_heads"]
    if stem == "attn_k":
        return config["num_key_value_heads"]
    return None


def _whole_tensor_loader(tensor: ReaderTensor, rope_heads: int | None, shape: tuple[int, ...] | None,
                         shift: float = 0.0) -> TensorLoader:
    """`shift`: taken off every value (GGUF_NORM_SHIFT), in float32: adding it back restores the
    file's value exactly where it is at least 0.5, within an ulp below."""
    def load() -> torch.Tensor:
        out = _dequantize_to_torch(tensor.data, tensor.tensor_type)
        if rope_heads is not None:
            out = _unpermute_llama_rope_rows(out, rope_heads)
        if shift:
            out -= shift
        return out if shape is None else out.reshape(shape)

    return load


def _expert_loader(tensor: ReaderTensor, expert: int) -> TensorLoader:
    # Slice the raw (still quantized) bytes first so only one expert is dequantized.
    def load() -> torch.Tensor:
        return _dequantize_to_torch(tensor.data[expert], tensor.tensor_type)

    return load


def _layer_entries(
    tensor: ReaderTensor, layer: str, stem: str, kind: str, config: dict, tensors: dict[str, ReaderTensor]
) -> Iterator[tuple[str, TensorLoader]]:
    prefix = f"model.layers.{layer}."
    if stem == CORRECTION_BIAS:
        yield f"{prefix}mlp.gate.e_score_correction_bias", _whole_tensor_loader(tensor, None, None)
        return
    if stem in SPLIT_KV_B:  # the pair is one HF tensor, yielded once (with k_b)
        if stem == SPLIT_KV_B[0]:
            k_b, v_b = tensor, tensors[f"blk.{layer}.{SPLIT_KV_B[1]}.weight"]
            yield f"{prefix}self_attn.kv_b_proj.weight", lambda: merged_kv_b(
                _dequantize_to_torch(k_b.data, k_b.tensor_type), _dequantize_to_torch(v_b.data, v_b.tensor_type))
        return
    if stem in GGUF_STACKED_EXPERT_TENSOR_TO_HF:
        proj = GGUF_STACKED_EXPERT_TENSOR_TO_HF[stem]
        for expert in range(tensor.data.shape[0]):
            yield f"{prefix}mlp.experts.{expert}.{proj}.{kind}", _expert_loader(tensor, expert)
        return
    # HF's shared_expert_gate is Linear(hidden, 1); llama.cpp stores it as a flat vector.
    shape = (1, -1) if stem == "ffn_gate_inp_shexp" else None
    loader = _whole_tensor_loader(tensor, _llama_rope_heads(config, stem), shape, _norm_shift(tensor, config))
    hf = GGUF_ARCH_LAYER_TENSOR_TO_HF.get(config["model_type"], {}).get(stem) or LAYER_TENSORS[stem]
    yield f"{prefix}{hf}.{kind}", loader


def _norm_shift(tensor: ReaderTensor, config: dict) -> float:
    return GGUF_NORM_SHIFT.get(config["model_type"], 0.0) if tensor.name.endswith("norm.weight") else 0.0


LAYER_STEMS = frozenset(LAYER_TENSORS) | frozenset(GGUF_STACKED_EXPERT_TENSOR_TO_HF) | {CORRECTION_BIAS, *SPLIT_KV_B}


def _tensor_entries(tensor: ReaderTensor, config: dict,
                    tensors: dict[str, ReaderTensor]) -> Iterator[tuple[str, TensorLoader]]:
    if tensor.name in GGUF_GLOBAL_TENSOR_TO_HF:
        yield GGUF_GLOBAL_TENSOR_TO_HF[tensor.name], _whole_tensor_loader(tensor, None, None,
                                                                          _norm_shift(tensor, config))
        return
    if tensor.name in GGUF_ROPE_FACTOR_TENSORS:  # the config's rope scaling (gguf_metadata), not a weight
        return
    match = _LAYER_TENSOR_RE.fullmatch(tensor.name)
    stem = match["stem"] if match else None
    if match and stem in LAYER_STEMS:
        yield from _layer_entries(tensor, match["layer"], stem, match["kind"], config, tensors)
        return
    # Unknown: pass through under its GGUF name so the caller can report it as unexpected rather
    # than silently dropping it.
    yield tensor.name, _whole_tensor_loader(tensor, None, None)


def iter_gguf_tensors(path: str) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """Yield `(hf_name, load_fn)` for every tensor in the file, in file order.

    `load_fn()` dequantizes only that tensor to a float32 torch tensor in HF shape (llama Q/K
    rows un-permuted). Stacked MoE expert tensors yield one entry per expert. Tensors with no
    HF equivalent are yielded under their raw GGUF name.
    """
    reader = open_header(path)
    config = config_from_reader(reader)
    tensors = {t.name: t for t in reader.tensors}
    for tensor in reader.tensors:
        yield from _tensor_entries(tensor, config, tensors)


def _quantized_loader(tensor: ReaderTensor, config: dict) -> Callable[[], QuantWeight] | None:
    """The tensor's raw blocks as a QuantWeight [rows, cols] (llama Q/K rows un-permuted, which
    moves whole rows of blocks), for 2-D weights in a format with a kernel; else None."""
    match = _LAYER_TENSOR_RE.fullmatch(tensor.name)
    if int(tensor.tensor_type) not in FORMATS or tensor.data.ndim != 2 or (match and match["kind"] != "weight"):
        return None
    if match and match["stem"] not in LAYER_TENSORS:
        return None
    rope_heads = _llama_rope_heads(config, match["stem"]) if match else None
    cols = int(tensor.shape[0])  # GGUF lists dims innermost first

    def load() -> QuantWeight:
        data = torch.from_numpy(np.array(tensor.data, copy=True))
        if rope_heads is not None:
            data = _unpermute_llama_rope_rows(data, rope_heads)
        return QuantWeight(int(tensor.tensor_type), data, cols)

    return load


def _expert_blocks(tensor: ReaderTensor, expert: int) -> Callable[[], QuantWeight]:
    """One expert of a stacked MoE tensor (bytes [experts, rows, row_bytes]) as its raw blocks."""
    return lambda: QuantWeight(int(tensor.tensor_type), torch.from_numpy(np.array(tensor.data[expert])),
                               int(tensor.shape[0]))


def gguf_sources(path: str, keep_quantized: bool) -> list[LazySource]:
    """The file's tensors as lazy sources (names and loaders only, no data yet). With
    `keep_quantized`, a weight in a format with a kernel is also offered in its blocks (a stacked
    MoE tensor expert by expert)."""
    reader = open_header(path)
    config = config_from_reader(reader)
    tensors = {t.name: t for t in reader.tensors}
    out = []
    for tensor in reader.tensors:
        entries = list(_tensor_entries(tensor, config, tensors))
        match = _LAYER_TENSOR_RE.fullmatch(tensor.name)
        if keep_quantized and match and match["stem"] in GGUF_STACKED_EXPERT_TENSOR_TO_HF \
                and int(tensor.tensor_type) in FORMATS:
            out.extend(LazySource(name, load, _expert_blocks(tensor, e)) for e, (name, load) in enumerate(entries))
            continue
        quantized = _quantized_loader(tensor, config) if keep_quantized else None
        shape = _hf_shape(tensor, match) if len(entries) == 1 else None
        out.extend(LazySource(name, load, quantized, shape) for name, load in entries)
    return out


def _hf_shape(tensor: ReaderTensor, match: re.Match | None) -> tuple[int, ...] | None:
    """The shape a tensor loads as, from the header alone, where it is the file's own (GGUF lists
    dims innermost first): a whole-model tensor or a plain layer weight or bias; None for those
    reshaped or merged on load."""
    if match is None and tensor.name not in GGUF_GLOBAL_TENSOR_TO_HF:
        return None
    if match is not None and (match["stem"] not in GGUF_LAYER_TENSOR_TO_HF or match["stem"] == "ffn_gate_inp_shexp"):
        return None
    return tuple(int(n) for n in reversed(tensor.shape))
