"""A GGUF file's metadata: its header parsed once per file version (`open_header`), translated
into a Hugging Face `config.json`-style dict (`read_gguf_config`: architecture, shapes, rotary
scaling, MoE and DeepSeek keys), and the `general.sampling.*` keys it may carry.

Tensors are gguf_loader.py's; the tokenizer is gguf_tokenizer.py's.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from shardserve.loader.gguf_deepseek import deepseek2_config, deepseek2_rope_scaling
from shardserve.loader.gguf_header import GGUFHeader, read_header
from shardserve.loader.gguf_names import (
    GGUF_ARCH_KEY_TO_HF_CONFIG,
    GGUF_ARCH_TO_HF_MODEL,
    GGUF_MOE_KEY_TO_HF_CONFIG,
    GGUF_ROPE_FACTOR_TENSORS,
    GGUF_TOKENIZER_KEY_TO_HF_CONFIG,
    MOE_ARCHS,
    NORM_TOPK_PROB_BY_ARCH,
)

# ----------------------------------------------------------------------------- reader


@functools.lru_cache(maxsize=2)
def _cached_reader(real_path: str, mtime_ns: int, size: int) -> GGUFHeader:
    del mtime_ns, size  # only part of the cache key, so a rewritten file is re-read
    return read_header(real_path)


def open_header(path: str) -> GGUFHeader:
    """Parse a GGUF header once per file version (config, tensors and tokenizer each read it).
    Tensor data is only memory-mapped, so keeping it costs page cache, not resident memory."""
    real_path = os.path.realpath(path)
    stat = os.stat(real_path)
    return _cached_reader(real_path, stat.st_mtime_ns, stat.st_size)


# ----------------------------------------------------------------------------- metadata


def _architecture(reader: GGUFHeader) -> str:
    arch = reader.fields.get("general.architecture")
    if arch not in GGUF_ARCH_TO_HF_MODEL:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCH_TO_HF_MODEL)}")
    return arch


def _copy_mapped_keys(reader: GGUFHeader, prefix: str, table: dict[str, str], out: dict) -> None:
    for gguf_suffix, hf_key in table.items():
        value = reader.fields.get(prefix + gguf_suffix)
        if value is not None:
            out[hf_key] = value


def _head_dim(reader: GGUFHeader, arch: str, config: dict) -> int:
    # Qwen3 decouples head_dim from hidden/heads, and llama.cpp records it as key_length;
    # older llama files only carry rope.dimension_count, which equals head_dim for full rope.
    # phi3's rope.dimension_count is the rotated part of a head (partial rotary: _partial_rotary).
    for suffix in ("attention.key_length",) + (() if arch in PARTIAL_ROTARY_ARCHS else ("rope.dimension_count",)):
        value = reader.fields.get(f"{arch}.{suffix}")
        if value is not None:
            return int(value)
    return config["hidden_size"] // config["num_attention_heads"]


# Architectures whose rope.dimension_count may be less than a head (the rotated leading dims).
PARTIAL_ROTARY_ARCHS = frozenset({"phi3"})


def _partial_rotary(reader: GGUFHeader, arch: str, head_dim: int) -> dict:
    rotated = reader.fields.get(f"{arch}.rope.dimension_count")
    if arch not in PARTIAL_ROTARY_ARCHS or rotated is None or int(rotated) == head_dim:
        return {}
    return {"rotary_dim": int(rotated)}  # the width itself: a factor would round it back down


def _rope_factors(reader: GGUFHeader, arch: str) -> dict | None:
    """Rope scaling kept as tensors of per-frequency divisors: phi3's LongRoPE sets, or llama
    3.x's "llama3" scaling, which llama.cpp's converter writes as rope_freqs and no metadata."""
    tables = {t.name: t for t in reader.tensors if t.name in GGUF_ROPE_FACTOR_TENSORS}
    if not tables:
        return None

    def floats(name: str) -> list[float]:
        t = tables[name]
        if t.data.dtype not in (np.float32, np.float16):
            raise ValueError(f"GGUF tensor {name} is {t.tensor_type.name}; rotary factors must be F32 or F16")
        return np.asarray(t.data, dtype=np.float32).reshape(-1).tolist()

    long_short = {"rope_factors_long.weight", "rope_factors_short.weight"} & set(tables)
    if len(long_short) == 1:
        raise ValueError(f"GGUF has {long_short.pop()} without its pair: LongRoPE needs rope_factors_long and "
                         "rope_factors_short")
    if long_short:
        scaling: dict[str, Any] = {"rope_type": "longrope", "long_factor": floats("rope_factors_long.weight"),
                                   "short_factor": floats("rope_factors_short.weight")}
        if (original := reader.fields.get(f"{arch}.rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = int(original)
        if (attn := reader.fields.get(f"{arch}.rope.scaling.attn_factor")) is not None:
            scaling["attention_factor"] = float(attn)
        return scaling
    return {"rope_type": "freq_factors", "factors": floats("rope_freqs.weight")}


def _rope_scaling(reader: GGUFHeader, arch: str) -> dict | None:
    kind = reader.fields.get(f"{arch}.rope.scaling.type")
    factor = reader.fields.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or factor is None:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = reader.fields.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _moe_config(reader: GGUFHeader, arch: str) -> dict:
    moe: dict[str, Any] = {}
    _copy_mapped_keys(reader, f"{arch}.", GGUF_MOE_KEY_TO_HF_CONFIG, moe)
    if arch in MOE_ARCHS:
        # Every layer is sparse in llama.cpp's qwen MoE graphs.
        moe.setdefault("shared_expert_intermediate_size", 0)
        moe["norm_topk_prob"] = NORM_TOPK_PROB_BY_ARCH[arch]
        moe["decoder_sparse_step"] = 1
        moe["mlp_only_layers"] = []
    return moe


def config_from_reader(reader: GGUFHeader) -> dict:
    """The Hugging Face config (as a dict) of an opened GGUF header (read_gguf_config's work)."""
    arch = _architecture(reader)
    model_type, hf_arch = GGUF_ARCH_TO_HF_MODEL[arch]
    config: dict[str, Any] = {"architectures": [hf_arch], "model_type": model_type, "hidden_act": "silu"}
    _copy_mapped_keys(reader, f"{arch}.", GGUF_ARCH_KEY_TO_HF_CONFIG, config)
    _copy_mapped_keys(reader, "", GGUF_TOKENIZER_KEY_TO_HF_CONFIG, config)
    for key in ("bos_token_id", "eos_token_id"):  # the file's or none: never a config class's default
        config.setdefault(key, None)
    # Without a key/value head count the model is plain multi-head attention.
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config["head_dim"] = _head_dim(reader, arch, config)
    if "vocab_size" not in config:
        # Many converters omit {arch}.vocab_size; the token list is authoritative.
        config["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"])
    tensor_names = {t.name for t in reader.tensors}
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    # Q/K/V biases are a per-checkpoint choice (qwen2 has them, llama and qwen3 usually not);
    # the tensors themselves are the only record of it.
    config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    config["rope_theta"] = float(config.get("rope_theta", 10000.0))
    config["rms_norm_eps"] = float(config["rms_norm_eps"])
    tables, stated = _rope_factors(reader, arch), _rope_scaling(reader, arch)
    if tables and stated and tables["rope_type"] == "freq_factors":  # llama.cpp would apply both
        raise ValueError(f"GGUF has rope_freqs and {arch}.rope.scaling.type {stated['rope_type']!r}: both at once are "
                         "not implemented")
    if (scaling := tables or stated) is not None:
        config["rope_scaling"] = scaling
    config.update(_partial_rotary(reader, arch, config["head_dim"]))
    if window := reader.fields.get(f"{arch}.attention.sliding_window"):  # 0: none (llama.cpp's Phi-4)
        config["sliding_window"] = int(window)
    config.update(_moe_config(reader, arch))
    if arch == "llama" and config.get("num_experts"):  # llama.cpp writes Mixtral as llama with experts
        config.update(architectures=["MixtralForCausalLM"], model_type="mixtral")
    if arch in ("gemma2", "gemma3"):
        config.update(_gemma(reader, arch, config))
    if arch == "deepseek2":
        def value(suffix: str) -> Any:
            return reader.fields.get(f"{arch}.{suffix}")

        config.update(deepseek2_config(value))
        if "rope_scaling" in config:
            config["rope_scaling"] = deepseek2_rope_scaling(config["rope_scaling"], value)
    return config


def _gemma(reader: GGUFHeader, arch: str, config: dict) -> dict:
    """What llama.cpp takes for Gemma 2 and 3 where the file says nothing: every other layer
    (gemma2) or every sixth (gemma3) attends fully, else `attention.sliding_window_pattern`;
    gemma2's window 4096 and caps 50 and 30, gemma3 no window, no caps; gemma3's windowed layers'
    RoPE base 10000, else `rope.freq_base_swa`; queries scaled by the head width but 27B's (46
    or 62 layers) by hidden / heads, as Google's configs give query_pre_attn_scalar."""
    def value(suffix: str) -> Any:
        return reader.fields.get(f"{arch}.{suffix}")

    two = arch == "gemma2"
    out: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh",
                           "sliding_window": config.get("sliding_window") or (4096 if two else None),
                           "attn_logit_softcapping": value("attn_logit_softcapping") or (50.0 if two else None),
                           "final_logit_softcapping": value("final_logit_softcapping") or (30.0 if two else None)}
    base = value("rope.freq_base_swa")
    if two and base is not None and float(base) != config["rope_theta"]:
        raise ValueError(f"unsupported model option: gemma2.rope.freq_base_swa {base} (a RoPE base of the windowed "
                         f"layers apart from rope.freq_base {config['rope_theta']}) is not implemented")
    if not two:
        out["rope_local_base_freq"] = float(base or 10000.0)
    pattern = value("attention.sliding_window_pattern")
    if isinstance(pattern, int) and pattern == 0:  # llama.cpp's 0: every layer windowed
        pattern = [True] * config["num_hidden_layers"]
    if isinstance(pattern, list):
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern is not None:
        out["sliding_window_pattern"] = int(pattern)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    wide = config["num_hidden_layers"] == (46 if two else 62)
    out["query_pre_attn_scalar"] = hidden // heads if wide else config["head_dim"]
    return out


def read_gguf_config(path: str) -> dict:
    """Translate a GGUF file's metadata into a Hugging Face `config.json`-style dict.

    Raises ValueError if `general.architecture` is not one gguf_names.GGUF_ARCH_TO_HF_MODEL lists.
    `tie_word_embeddings` is True when the file has no `output.weight` tensor.
    """
    return config_from_reader(open_header(path))


# ----------------------------------------------------------------------------- sampling


def read_gguf_sampling(path: str) -> dict[str, Any]:
    """The `general.sampling.*` keys a GGUF may carry (llama.cpp's names), as raw values."""
    reader = open_header(path)
    prefix = "general.sampling."
    return {k.removeprefix(prefix): v for k, v in reader.fields.items() if k.startswith(prefix)}
