"""The tokenizer a GGUF file carries, as a transformers fast tokenizer, converted once per file.

transformers converts a GGUF's vocabulary and merges into a fast tokenizer by re-reading the
whole header with gguf-py (seconds for a 49k-token vocabulary), and every process that serves
the model (the API process, the tokenizer workers) would pay that at each start. The finished
tokenizer is saved under the cache root (native.cache_root()), keyed by the file's path, size
and modification time and by the transformers and tokenizers versions, and later starts load
it from there: the same files `save_pretrained` writes for any tokenizer.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardserve.loader.gguf_metadata import open_header
from shardserve.native import cache_root

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)
FORMAT = "1"  # bump when what is saved changes


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """The GGUF's tokenizer, with bos/eos from `tokenizer.ggml.{bos,eos}_token_id` and the
    chat template from `tokenizer.chat_template` (converters may not carry them over)."""
    from shardserve.loader.tokenizer_class import auto_tokenizer

    where = _cache_path(path)
    if (where / "tokenizer.json").exists():
        try:
            return _finish(auto_tokenizer(str(where)), path)
        except Exception as e:  # a damaged entry (any parser's error): convert again and replace it
            log.warning("cached tokenizer %s unreadable (%s); converting %s again", where, e, path)
            shutil.rmtree(where, ignore_errors=True)
    from transformers import AutoTokenizer  # heavy import, only needed to convert

    tokenizer = _finish(AutoTokenizer.from_pretrained(os.path.dirname(path) or ".",
                                                      gguf_file=os.path.basename(path)), path)
    _save(tokenizer, where)
    return tokenizer


def _finish(tokenizer: Any, path: str) -> Any:
    reader = open_header(path)
    for role in ("bos", "eos"):  # the ids the GGUF declares
        token_id = reader.fields.get(f"tokenizer.ggml.{role}_token_id")
        if token_id is not None:
            token = tokenizer.convert_ids_to_tokens(int(token_id))
            if getattr(tokenizer, f"{role}_token") != token:
                setattr(tokenizer, f"{role}_token", token)
    if template := reader.fields.get("tokenizer.chat_template"):
        tokenizer.chat_template = template
    return tokenizer


def _cache_path(path: str) -> Path:
    import tokenizers
    import transformers

    real = os.path.realpath(path)
    st = os.stat(real)
    key = "\0".join([FORMAT, real, str(st.st_size), str(st.st_mtime_ns), transformers.__version__,
                     tokenizers.__version__])
    return cache_root() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def _signature(tokenizer: Any) -> tuple:
    """What a saved tokenizer must read back as: every id's token, the added and special
    tokens, the chat template."""
    return (tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))), str(tokenizer.added_tokens_decoder),
            tokenizer.special_tokens_map, tokenizer.chat_template)


def _save(tokenizer: Any, where: Path) -> None:
    """Write the entry whole or not at all: into a temporary folder, read back and compared,
    then one rename (another process converting the same file at the same time keeps whichever
    lands first). A tokenizer whose saved form reads back otherwise is not cached. The entry's
    tokenizer class is remembered too (loader/tokenizer_class.py), so the next start needs neither."""
    from transformers import AutoTokenizer

    from shardserve.loader.tokenizer_class import remember_class

    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=where.parent, prefix=".tmp-")
        try:
            tokenizer.save_pretrained(tmp)
            back = AutoTokenizer.from_pretrained(tmp)
            if _signature(back) != _signature(tokenizer):
                log.warning("the tokenizer converted from the GGUF does not read back the same from its saved "
                            "files; not cached (each start converts it again)")
                return
            os.replace(tmp, where)  # the files keep their sizes and times: the key is the entry's
            remember_class(str(where), type(back))
        except OSError:
            if not (where / "tokenizer.json").exists():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        log.warning("cannot cache the converted tokenizer in %s (%s): each start converts it again", where, e)
