"""Run a function on N gloo ranks in spawned processes and collect what each returns."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import socket
import traceback
from datetime import timedelta

import torch.distributed as dist

from shardserve.distributed.communicator import Communicator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, queue, group_timeout: float | None = None) -> None:
    try:
        extra = {"timeout": timedelta(seconds=group_timeout)} if group_timeout else {}
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **extra)
        group = dist.new_group(list(range(world)), **extra)
        # Plain pickle, not the queue's: torch would share tensors by file descriptor, and the
        # descriptor's owner (this process) may be gone before the parent unpickles them.
        queue.put((rank, pickle.dumps(fn(Communicator(group, rank, world, "test"))), None))
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def run_ranks(fn, world: int, timeout: float = 120, report: int | None = None,
              group_timeout: float | None = None) -> list:
    """fn(comm) runs on every rank; returns the results ordered by rank (only the first
    `report` ranks are waited for, when some are meant to die). `group_timeout` bounds every
    collective, as --dist-timeout does."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, queue, group_timeout)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world if report is None else report):
            rank, value, err = queue.get(timeout=timeout)
            if err:
                raise AssertionError(f"rank {rank} failed:\n{err}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in sorted(results)]
