"""One rank's process on the node Ray placed it: the actor that starts it, and the launcher's handle.

`RankHost` is a Ray actor in one bundle of a replica's placement group. It starts the rank as
the same command every local child runs (`python -m shardserve.launch.worker NAME`, the pickled
`(function, args)` on its standard input), so a rank behaves alike whoever started it: it dies
with its parent (the actor) and reports Ready or Failed to the launcher's ready channel.
`RemoteProc` gives the launcher what `subprocess.Popen` gives it for a local child (poll, wait,
terminate, kill, returncode), so the process tree and the replica supervisor treat both alike;
an actor (or its node) that is gone reads as a rank killed, with Ray's reason.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from shardserve.ipc.secure import SECRET_ENV
from shardserve.launch.worker import PARENT_ENV

CALL_TIMEOUT = 2.0  # seconds an actor has to answer a poll or a signal; a silent one is asked again later


class RankHost:
    """The actor's body (made a Ray actor by launch/ray_cluster.py): the rank processes it
    started, by pid (a restart's new process never takes over the old one's handle)."""

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}

    def ping(self) -> bool:
        return True

    def where(self) -> dict:
        """This node's Ray id and address, and the GPUs Ray gave this actor."""
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def free_port(self, span: int) -> int:
        """A port free on this node now with the `span - 1` after it free too."""
        import ray

        return free_base(ray.util.get_node_ip_address(), span)

    def spawn(self, name: str, payload: bytes, env: dict[str, str]) -> int:
        """Start the rank `name`; `payload` is the pickled (function, args) it runs. Its pid.
        A previous rank process still here (killed, not yet gone) is killed and reaped first."""
        for pid, old in list(self.procs.items()):
            if old.poll() is None:
                old.kill()
                old.wait(10)
            del self.procs[pid]
        # Whatever environment Ray's daemons were started with, the secret is not passed on: the
        # rank has it in its arguments.
        full = {k: v for k, v in os.environ.items() if k != SECRET_ENV} | env | {PARENT_ENV: str(os.getpid())}
        proc = subprocess.Popen([sys.executable, "-m", "shardserve.launch.worker", name], stdin=subprocess.PIPE,
                                env=full)
        proc.stdin.write(payload)
        proc.stdin.close()
        self.procs[proc.pid] = proc
        return proc.pid

    def poll(self, pid: int) -> int | None:
        proc = self.procs.get(pid)
        return proc.poll() if proc is not None else -signal.SIGKILL  # replaced by a later spawn: killed

    def signal(self, pid: int, sig: int) -> None:
        proc = self.procs.get(pid)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)


def free_base(ip: str, span: int) -> int:
    """A port on `ip` free now, as are the `span - 1` ports after it (a block of channels)."""
    while True:
        with socket.socket() as s:
            s.bind((ip, 0))
            base = s.getsockname()[1]
        if base + span - 1 <= 65535 and all(_free(ip, base + k) for k in range(1, span)):
            return base


def _free(ip: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


def actor_died(error: BaseException) -> str:
    """Ray's reason an actor is gone, in one line: its "... is dead because ..." sentence (the
    worker process died, the node died), without the advice Ray appends."""
    lines = [line.strip() for line in str(getattr(error, "error_msg", "") or error).splitlines() if line.strip()]
    why = next((line for line in lines if "dead because" in line), lines[0] if lines else type(error).__name__)
    return why.split(" Some common causes")[0].strip()


def node_alive(node_id: str) -> bool:
    import ray

    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


class RemoteProc:
    """The launcher's handle on a rank started by a `RankHost` (a subset of `subprocess.Popen`)."""

    def __init__(self, actor, pid: int, who: str, node_id: str):
        """`who` names the rank and its node, e.g. 'rank 3 on node 5ab1.. (dp 1, tp 1)'."""
        self.actor, self.pid, self.who, self.node_id = actor, pid, who, node_id
        self.returncode: int | None = None
        self.ended = ""  # set when the actor or its node is gone: what ProcessTree reports

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        import ray

        try:
            code = ray.get(self.actor.poll.remote(self.pid), timeout=CALL_TIMEOUT)
        except (ray.exceptions.GetTimeoutError, getattr(ray.exceptions, "ActorUnavailableError", TimeoutError)):
            return None  # busy, slow or briefly unreachable: asked again on the next poll
        except ray.exceptions.RayActorError as e:
            self.returncode = -signal.SIGKILL
            why = actor_died(e)
            self.ended = f"{self.who} died: " + (why if node_alive(self.node_id) else f"its Ray node is gone ({why})")
            return self.returncode
        self.returncode = code
        return code

    def _signal(self, sig: int) -> None:
        import ray

        try:
            ray.get(self.actor.signal.remote(self.pid, sig), timeout=CALL_TIMEOUT)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass  # gone already, or stopped with its actor

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.who, timeout)
            time.sleep(0.05)
        return self.returncode
