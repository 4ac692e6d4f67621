"""The tokenizer class AutoTokenizer chooses for a checkpoint, remembered.

`AutoTokenizer.from_pretrained` picks the tokenizer's class by reading the checkpoint's config
through `AutoConfig`, which imports the model's configuration module and with it torch and much
of transformers: over a second of CPU in each process that loads a tokenizer (every tokenizer
worker, the detokenizer, the leader rank), where the tokenizer itself loads in a fraction of that.
The class it picked is remembered under the cache root, keyed by what can sway the choice: the
path (as given, which AutoTokenizer matches against some Hub names, and resolved), the files
(size, modification time), the transformers and tokenizers versions and whether mistral-common
is installed. Later loads call that class's own `from_pretrained`, the call AutoTokenizer ends
with, without importing AutoConfig, the model's configuration module or torch; where that call
fails, AutoTokenizer chooses again.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from shardserve.native import cache_root

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Files whose change may change the choice (config.json: the model type, its tokenizer class;
# tekken.json: Mistral's own format), and the tokenizer's own (a change costs one more choice).
CHOICE_FILES = ("config.json", "tekken.json", *TOKENIZER_FILES, "merges.txt", "special_tokens_map.json")
FORMAT = "1"  # bump when what a class entry holds changes
log = logging.getLogger(__name__)


def auto_tokenizer(directory: str) -> PreTrainedTokenizerBase:
    """What `AutoTokenizer.from_pretrained(directory)` returns, through the class it chose last
    time for the same files (see the module's docstring)."""
    entry = _entry(directory)
    cls = _remembered(entry)
    if cls is not None:
        try:
            return cls.from_pretrained(directory)
        except Exception as e:  # e.g. a backend uninstalled since: AutoTokenizer chooses again
            log.debug("the remembered tokenizer class %s failed on %s (%s); choosing again", cls, directory, e)
    from transformers import AutoTokenizer  # here: a rank that never loads a tokenizer skips its import

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # a damaged or unsupported file: one line naming the folder, not a traceback
        raise ValueError(f"the tokenizer in {directory} does not load: {type(e).__name__}: {e}") from e
    _remember(entry, type(tokenizer), directory)
    return tokenizer


def remember_class(directory: str, cls: type) -> None:
    """Record that AutoTokenizer chose `cls` for `directory` as its files are now."""
    _remember(_entry(directory), cls, directory)


def _entry(directory: str) -> Path:
    return cache_root() / "tokenizer-classes" / f"{_choice_key(directory)}.json"


def _choice_key(directory: str) -> str:
    import tokenizers
    import transformers

    real = os.path.realpath(directory)
    mistral = importlib.util.find_spec("mistral_common") is not None  # AutoTokenizer's Mistral choice
    parts = [FORMAT, directory, real, transformers.__version__, tokenizers.__version__, str(mistral)]
    for name in CHOICE_FILES:
        try:
            st = os.stat(os.path.join(real, name))
            parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            parts.append(f"{name}:-")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _remembered(entry: Path) -> type | None:
    """The class an entry names; None where there is none or it no longer reads (any fault: the
    slow path then chooses again and rewrites it)."""
    try:
        with open(entry) as f:
            saved = json.load(f)
        if not saved["module"].startswith("transformers."):  # only those _remember writes
            return None
        cls = getattr(importlib.import_module(saved["module"]), saved["name"])
    except Exception:
        return None
    return cls if isinstance(cls, type) else None


def _remember(entry: Path, cls: type, directory: str) -> None:
    """Only transformers' own classes: a checkpoint's remote code is chosen by AutoTokenizer each
    time (its trust checks live there). The write is one rename, so racing processes are safe."""
    if not cls.__module__.startswith("transformers."):
        return
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            if "auto_map" in json.load(f):
                return
    except (OSError, ValueError):
        pass
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-")
        os.fchmod(fd, 0o644)  # readable by others sharing the cache, as the kernels are
        with os.fdopen(fd, "w") as f:
            json.dump({"module": cls.__module__, "name": cls.__name__}, f)
        os.replace(tmp, entry)
    except OSError as e:
        log.warning("cannot remember the tokenizer's class in %s (%s): each start chooses it again, "
                    "importing the model's config", entry.parent, e)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
