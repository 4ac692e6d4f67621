"""Load the tokenizer (and its chat template) that belongs to a checkpoint."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from shardserve.loader.model_path import Checkpoint


def load_tokenizer(ckpt: Checkpoint) -> PreTrainedTokenizerBase:
    if ckpt.is_gguf:
        from shardserve.loader.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(ckpt.path)
    return AutoTokenizer.from_pretrained(ckpt.path)
