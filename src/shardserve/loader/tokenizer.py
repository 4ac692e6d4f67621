"""Load the tokenizer (and its chat template) that belongs to a checkpoint."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from shardserve.loader.model_path import Checkpoint
from shardserve.loader.tokenizer_class import TOKENIZER_FILES, auto_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(ckpt: Checkpoint) -> PreTrainedTokenizerBase | None:
    """The checkpoint's tokenizer, or None when it ships none (token-id prompts only then)."""
    if ckpt.is_gguf:
        from shardserve.loader.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(ckpt.path)
    if not any(os.path.exists(os.path.join(ckpt.path, f)) for f in TOKENIZER_FILES):
        return None
    return auto_tokenizer(ckpt.path)
