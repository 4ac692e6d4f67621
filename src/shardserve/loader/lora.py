"""PEFT LoRA adapters on disk: read and check one without torch (the API process never loads it).

An adapter is a directory holding `adapter_config.json` and `adapter_model.safetensors`, as
PEFT's `save_pretrained` writes them. Each tensor is named like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in]) or `...lora_B.weight`
([out, r]); a layer's output becomes W x + scale * B (A x), where scale is lora_alpha / r, or
lora_alpha / sqrt(r) with use_rslora, as PEFT defines it.

`read_adapter` checks everything a server can check before serving one: the files, PEFT options
this engine does not implement, the rank against --max-lora-rank, and every tensor's layer, module
and shape against the base model. Each failure is one line naming the adapter.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

# The projections an adapter may target, by the module's place in a decoder layer.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_SUB = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
        "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "qkv_proj": "self_attn", "gate_up_proj": "mlp"}
# Projections some checkpoints store fused (Phi-3's), which their adapters name so: such an adapter
# adapts each piece with its one A and the piece's rows of its B, in order (`unfuse`).
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# PEFT's names (base_model.model. before the model's own), or the model's own alone: a decoder
# layer's projection; a vision-language checkpoint's under its language model (Gemma 3's 4B-27B:
# language_model.model.layers, or model.language_model.layers).
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\."
                  r"(self_attn|mlp)\.(\w+?)\.lora_(A|B)(?:\.\w+)?\.weight$")
MAX_HEADER = 100 * 2**20  # safetensors' own bound on a header
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# PEFT options that change the arithmetic; an adapter using one is refused, never run without it.
_UNSUPPORTED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)"}
_FLOAT_DTYPES = ("F32", "F16", "BF16")


def submodule(module: str) -> str:
    """'q_proj' -> 'self_attn.q_proj': where it sits in a decoder layer (Hugging Face's names)."""
    return f"{_SUB[module]}.{module}"


def module_shapes(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection of a llama-family decoder layer."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter must fit: the layers and, per supported target, the projection's (in, out)."""

    num_layers: int
    modules: dict[str, tuple[int, int]]


def base_shapes(model_cfg) -> BaseShapes:
    """What adapters may target on this model (a config.ModelConfig): every projection of a dense
    llama-family model; a MoE model's attention projections only (its experts take none)."""
    mc = model_cfg
    shapes = module_shapes(mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.intermediate_size)
    if mc.num_experts:
        shapes = {m: s for m, s in shapes.items() if _SUB[m] == "self_attn"}
    return BaseShapes(mc.num_layers, shapes)


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: its rank, the scale its B is multiplied by, and the modules it adapts."""

    name: str
    path: str
    rank: int
    scale: float
    modules: tuple[str, ...]


def parse_key(name: str) -> tuple[int, str, str] | None:
    """(layer, module, 'A' or 'B') of an adapter tensor's name, or None for another tensor."""
    m = _KEY.match(name)
    if m is None or _SUB.get(m.group(3)) != m.group(2):
        return None
    return int(m.group(1)), m.group(3), m.group(4)


def safetensors_header(path: str) -> dict[str, dict]:
    """The tensors a .safetensors file lists ({name: {dtype, shape, data_offsets}}), read from its
    JSON header alone."""
    with open(path, "rb") as f:
        raw = f.read(8)
        size = _header_size(raw, os.path.getsize(path))
        return _decode_header(f.read(size), os.path.getsize(path) - 8 - size)


def header_of(data: bytes) -> dict[str, dict]:
    """The same, of a whole file's bytes, each tensor's bytes checked to lie inside them."""
    size = _header_size(data[:8], len(data))
    return _decode_header(data[8 : 8 + size], len(data) - 8 - size)


def _header_size(raw: bytes, total: int) -> int:
    if len(raw) != 8:
        raise ValueError("it is not a safetensors file (shorter than its 8-byte header length)")
    (size,) = struct.unpack("<Q", raw)
    if size > min(total - 8, MAX_HEADER):
        raise ValueError(f"it is not a safetensors file (a header of {size} bytes)")
    return size


def _decode_header(text: bytes, body: int) -> dict[str, dict]:
    """The header's tensors, each entry's fields checked: {dtype, shape, data_offsets} within the
    `body` bytes after the header."""
    try:
        header = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"its safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("its safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    for key, info in header.items():
        ok = (isinstance(info, dict) and isinstance(info.get("dtype"), str)
              and isinstance(info.get("shape"), list) and all(_count(n) for n in info["shape"])
              and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
              and all(_count(n) for n in info["data_offsets"])
              and info["data_offsets"][0] <= info["data_offsets"][1] <= body)
        if not ok:
            raise ValueError(f"its safetensors header's entry for {key!r} is malformed or runs past the file")
    return header


def _count(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _config(name: str, path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a directory")
    where = os.path.join(path, CONFIG)
    if not os.path.isfile(where):
        raise ValueError(f"LoRA adapter {name!r}: {path} has no {CONFIG} (a PEFT adapter directory holds one)")
    try:
        with open(where) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"LoRA adapter {name!r}: {where} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {name!r}: {where} is not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type is {cfg['peft_type']!r}, not LORA")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias {cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {name!r}: modules_to_save {cfg['modules_to_save']} is not supported "
                         "(only LoRA matrices on the attention and MLP projections)")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {name!r}: a per-module {key} is not supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if (not _count(r) or r < 1 or isinstance(alpha, bool) or not isinstance(alpha, int | float)
            or not math.isfinite(alpha)):
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG} needs an integer r >= 1 and a number lora_alpha "
                         f"(got r={r!r}, lora_alpha={alpha!r})")
    return cfg


def read_adapter(name: str, path: str, base: BaseShapes, max_rank: int, data: bytes | None = None) -> AdapterSpec:
    """The adapter at `path`, checked against the base model and --max-lora-rank; ValueError (one
    line naming it) for anything this engine would not run exactly as PEFT does. With `data` (the
    weights file's bytes, read once) the check is of those bytes, not of the file read again."""
    cfg = _config(name, path)
    r, alpha = cfg["r"], cfg["lora_alpha"]
    if r > max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {r} exceeds --max-lora-rank {max_rank}")
    weights = os.path.join(path, WEIGHTS)
    if not os.path.isfile(weights):
        raw = " (adapter_model.bin, a pickle, is not read: save it with safe_serialization)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        raise ValueError(f"LoRA adapter {name!r}: {path} has no {WEIGHTS}{raw}")
    try:
        header = safetensors_header(weights) if data is None else header_of(data)
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: {weights}: {e}") from None
    modules, pairs = set(), {}
    for key, info in header.items():
        parsed = parse_key(key)
        if parsed is None:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA matrix of a decoder layer's "
                             "projection")
        layer, module, ab = parsed
        parts = FUSED_TARGETS.get(module, (module,))
        if any(p not in base.modules for p in parts):
            known = ", ".join(base.modules) or "none"
            raise ValueError(f"LoRA adapter {name!r}: target module {module!r} is not one this model adapts "
                             f"(supported here: {known})")
        if layer >= base.num_layers:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is for layer {layer}; the base model has "
                             f"{base.num_layers} layers")
        if info.get("dtype") not in _FLOAT_DTYPES:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} has dtype {info.get('dtype')}; expected one of "
                             f"{', '.join(_FLOAT_DTYPES)}")
        fan_in, fan_out = base.modules[parts[0]][0], sum(base.modules[p][1] for p in parts)
        want = [r, fan_in] if ab == "A" else [fan_out, r]
        if list(info.get("shape", ())) != want:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} has shape {info.get('shape')}, expected {want} "
                             "(rank r from its config, the base model's projection size): is it for another base "
                             "model?")
        for part in parts:  # a fused projection and one of its pieces adapted apart: two of one
            modules.add(part)
            seen = pairs.setdefault((layer, part), set())
            if ab in seen:
                raise ValueError(f"LoRA adapter {name!r}: layer {layer} {part} has two lora_{ab} tensors")
            seen.add(ab)
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: {weights} holds no LoRA matrices")
    lone = next(((layer, m) for (layer, m), abs_ in pairs.items() if len(abs_) != 2), None)
    if lone is not None:
        raise ValueError(f"LoRA adapter {name!r}: layer {lone[0]} {lone[1]} has lora_A or lora_B but not both")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return AdapterSpec(name, os.path.abspath(path), r, float(scale), tuple(sorted(modules, key=TARGETS.index)))


def fused_rows(module: str, rows: dict[str, int]) -> list[tuple[str, int, int]]:
    """(piece, first row, end) of each piece of fused projection `module` in its output rows, in
    order (`rows`: each piece's output size, module_shapes' out); the checkpoint loader cuts such
    a tensor so (models/phi3.py), and `unfuse` an adapter's B."""
    out, at = [], 0
    for p in FUSED_TARGETS[module]:
        out.append((p, at, at + rows[p]))
        at += rows[p]
    return out


def unfuse(module: str, ab: str, matrix, rows: dict[str, int]) -> list[tuple[str, Any]]:
    """(piece, matrix) for an adapter's lora_`ab` matrix of `module`: itself, or for a fused
    projection each piece's: A whole, B's rows in order (`rows`: each piece's output size)."""
    if module not in FUSED_TARGETS:
        return [(module, matrix)]
    if ab == "A":
        return [(p, matrix) for p in FUSED_TARGETS[module]]
    return [(p, matrix[start:end]) for p, start, end in fused_rows(module, rows)]


def parse_lora_module(text: str) -> tuple[str, str]:
    """--lora-modules' `name=path` (or vLLM's JSON form {"name": .., "path": ..})."""
    text = text.strip()
    if text.startswith("{"):
        try:
            d = json.loads(text)
            return str(d["name"]), str(d["path"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"--lora-modules {text!r}: JSON form needs 'name' and 'path'") from None
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path")
    return name, path
