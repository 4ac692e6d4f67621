"""A replica's death and return (in-server data parallelism), between the API process, which
watches the processes, and the router, which places requests.

    API process --ReplicaDown / ReplicaUp--> router
    router --ReplicaLost (what was placed on the dead replica)--> API process
    router --DropStreams--> detokenizer (those requests will send no final token)
"""

from __future__ import annotations

from shardserve.ipc.messages.base import Msg


class ReplicaDown(Msg):
    """Replicas that died together (one, or every replica under data-parallel attention)."""

    replicas: list[int]
    reason: str


class ReplicaUp(Msg):
    replicas: list[int]


class ReplicaLost(Msg):
    """The requests the router had placed on a replica that died, not yet reported ended."""

    replica: int
    rids: list[str]
    reason: str


class DropStreams(Msg):
    rids: list[str]
