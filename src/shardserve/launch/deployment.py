"""What one `shardserve serve` deploys, built once from the flags and handed down as a whole."""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.config import EngineConfig
from shardserve.distributed.layout import Layout
from shardserve.launch.nodes import NodeSpec


@dataclass(frozen=True)
class Deployment:
    """The engine's settings, the rank grid and this machine's place in it.

    The command line builds it from the flags (cli/flags.py), `LLM(...)` from its arguments, and
    both check it against the checkpoint in one pass (launch/checks.check_deployment) before any
    process starts; nothing below re-reads the flags.
    """

    engine: EngineConfig
    layout: Layout
    node: NodeSpec
