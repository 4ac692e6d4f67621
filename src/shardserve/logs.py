"""The log level every process of a deployment logs at (plain Python: the CLI reads it while parsing)."""

from __future__ import annotations

import logging
import os

# The launcher's --log-level, inherited by every child it starts (ipc/child.py's setup_logging reads it).
LOG_LEVEL_ENV = "SHARDSERVE_LOG_LEVEL"
LOG_LEVELS = ("debug", "info", "warning", "error")


def use_log_level(level: str) -> None:
    """`level` for this process's shardserve loggers and, through the environment, for every
    child it starts from now on (tokenizers, scheduler ranks)."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {list(LOG_LEVELS)}, got {level!r}")
    os.environ[LOG_LEVEL_ENV] = level
    logging.getLogger("shardserve").setLevel(level.upper())
