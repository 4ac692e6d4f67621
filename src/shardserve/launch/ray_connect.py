"""Reaching a Ray cluster for `--distributed-executor-backend ray`, and what the ranks take along.

Ray is an optional extra: without it, one line says how to install it. `connect` bounds what
Ray leaves unbounded: an address where nothing answers is refused at once (Ray retries it for
ever), and the connection itself has CONNECT_WAIT seconds.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from shardserve.ipc.secure import SECRET_ENV
from shardserve.launch import LaunchError

# Environment the ranks need from this one (interfaces, kernel switches, Hugging Face's cache);
# passed by name to every rank, values never logged. The secret travels in the arguments instead.
PASSED_ENV = ("NCCL_", "GLOO_", "TORCH_", "SHARDSERVE_", "HF_", "TRANSFORMERS_")
INSTALL = "pip install 'shardserve[ray]'"
NAMESPACE = "shardserve"
CONNECT_WAIT = 60.0  # seconds for ray.init to reach the cluster


def import_ray():
    # Ray folds log lines that differ only in numbers into one "[repeated Nx]" (read at import):
    # each rank's lines are kept.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        import ray
    except ImportError:
        raise LaunchError(f"--distributed-executor-backend ray needs Ray: {INSTALL}", exit_code=2) from None
    return ray


def connect(ray, flag: str) -> None:
    """ray.init on `flag` (--ray-address), else RAY_ADDRESS, else a cluster started here. Ray
    retries an address that does not answer for ever: a GCS port that refuses is said at once,
    and a connection that never completes gives up after CONNECT_WAIT s."""
    if os.environ.get("RAY_ADDRESS") == "":
        del os.environ["RAY_ADDRESS"]  # empty is unset
    address = flag or os.environ.get("RAY_ADDRESS") or local_cluster(ray)
    where = f"--ray-address {flag}" if flag else f"RAY_ADDRESS {address}" if os.environ.get("RAY_ADDRESS") \
        else f"Ray (the cluster started here, {address})"
    if address not in ("auto", "local"):
        try:
            answers(address)
        except (OSError, ValueError) as e:
            raise LaunchError(f"{where}: no Ray cluster answers there ({e})", exit_code=2) from None
    done, failed = threading.Event(), []

    def init() -> None:
        try:
            ray.init(address=address, namespace=NAMESPACE, include_dashboard=False, configure_logging=False)
        except Exception as e:  # reported by the waiting thread
            failed.append(e)
        done.set()

    if address == "local":  # starting Ray's daemons must be this (main) thread's: they die with their starter
        secret = os.environ.pop(SECRET_ENV, None)  # the daemons (and so the actors) never hold it
        try:
            init()
        finally:
            if secret is not None:
                os.environ[SECRET_ENV] = secret
        if failed:
            raise LaunchError(f"--distributed-executor-backend ray: cannot start Ray here: {failed[0]}",
                              exit_code=2) from None
        return
    # Connecting on a thread, to bound the wait; Ray then says it set no SIGTERM handler (ours are).
    quiet = logging.getLogger("ray._private.worker")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        threading.Thread(target=init, name="ray-connect", daemon=True).start()
        if not done.wait(CONNECT_WAIT):
            raise LaunchError(f"{where}: Ray did not connect within {CONNECT_WAIT:.0f} s", exit_code=2)
    finally:
        quiet.level = level
    if failed:
        raise LaunchError(f"{where}: {failed[0]}", exit_code=2) from None


def answers(address: str) -> None:
    """Raise OSError unless something accepts a connection at `address` (host:port)."""
    host, _, port = address.rpartition(":")
    socket.create_connection((host, int(port)), timeout=5).close()


def local_cluster(ray) -> str:
    """With no address: the address of a cluster started on this machine (`ray start`) that
    answers, else "local" (start one for this command). Ray itself would try the last cluster
    started here even when it is gone, and retry it for ever."""
    try:
        last = ray._private.utils.read_ray_address()
        if last:
            answers(last)
            return last
    except (AttributeError, OSError, ValueError):
        pass
    return "local"


def passed_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(PASSED_ENV) and k != SECRET_ENV}
