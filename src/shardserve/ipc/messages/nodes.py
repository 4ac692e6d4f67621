"""Between launchers of different machines (launch/nodes.py)."""

from __future__ import annotations

from shardserve.ipc.messages.base import Msg


class NodeHello(Msg):
    node_rank: int
    nnodes: int
    world: int
    layout: str
    model: str


class NodeWelcome(Msg):
    pass


class NodeRefused(Msg):
    reason: str


class NodeBeat(Msg):
    pass


class NodeFailed(Msg):
    reason: str


class NodeStop(Msg):
    pass
