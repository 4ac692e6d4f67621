"""A child process's start-up answer to its parent (Ready or Failed), and the order to stop."""

from __future__ import annotations

from shardserve.ipc.messages.base import Msg


class Ready(Msg):
    name: str
    info: dict = {}


class Failed(Msg):
    name: str
    error: str


class Shutdown(Msg):
    pass
