"""How every scheduler rank receives the same messages in the same order.

Rank 0 alone reads the tokenizers' PULL socket. Each step it broadcasts how many messages it
took over the gloo control group and publishes their raw bytes on a ZeroMQ PUB socket; every
other rank reads exactly that many from its SUB socket. With one rank this is a plain PULL.
"""

from __future__ import annotations

import time

import torch
import zmq

from shardserve.distributed.communicator import CollectiveError, Communicator
from shardserve.ipc.messages import Msg, decode
from shardserve.ipc.sockets import bind_address

SYNC = b"\x00sync"  # published at start-up until every subscriber has seen one; never counted


class Inbox:
    def __init__(self, ctx: zmq.Context, pull_addr: str, fanout_addr: str, control: Communicator,
                 timeout_s: float):
        self.control, self.rank, self.timeout_ms = control, control.rank, int(timeout_s * 1000)
        if self.rank == 0:
            self.pull = ctx.socket(zmq.PULL)
            self.pull.bind(pull_addr)
            if control.size > 1:
                self.pub = ctx.socket(zmq.PUB)
                self.pub.setsockopt(zmq.SNDHWM, 0)
                self.pub.bind(bind_address(fanout_addr))
        else:
            self.sub = ctx.socket(zmq.SUB)
            self.sub.setsockopt(zmq.RCVHWM, 0)
            self.sub.setsockopt(zmq.SUBSCRIBE, b"")
            self.sub.connect(fanout_addr)
        if control.size > 1:
            self._sync()

    def _sync(self) -> None:
        """ZeroMQ drops what a PUB sends before a SUB has joined: publish SYNC until all have one."""
        deadline = time.monotonic() + self.timeout_ms / 1000
        flag = torch.zeros(1, dtype=torch.int32)
        while True:
            if self.rank == 0:
                self.pub.send(SYNC)
                flag[0] = 1
            elif not flag[0] and self.sub.poll(50):
                flag[0] = int(self.sub.recv() == SYNC)
            agreed = self.control.all_reduce(flag.clone(), op="min")
            if agreed[0]:
                return
            if time.monotonic() > deadline:
                raise CollectiveError(f"rank {self.rank}: subscribers did not join the message fan-out in time")
            time.sleep(0.02)

    def receive(self, wait_ms: int) -> list[Msg]:
        """This step's messages; rank 0 waits up to `wait_ms` for the first when idle."""
        if self.rank == 0:
            raw = []
            if wait_ms and self.pull.poll(wait_ms):
                raw.append(self.pull.recv())
            while True:
                try:
                    raw.append(self.pull.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
            if self.control.size > 1:
                self.control.broadcast(torch.tensor([len(raw)], dtype=torch.int64))
                for r in raw:
                    self.pub.send(r)
            return [decode(r) for r in raw]
        count = self.control.broadcast(torch.zeros(1, dtype=torch.int64))
        return [decode(self._next()) for _ in range(int(count[0]))]

    def _next(self) -> bytes:
        while True:
            if not self.sub.poll(self.timeout_ms):
                raise CollectiveError(f"rank {self.rank}: no fanned-out message from rank 0 in time")
            data = self.sub.recv()
            if data != SYNC:
                return data
