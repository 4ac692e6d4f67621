"""The leader's inbox and the plan feed that keeps every other rank of the replica in step.

The leader (control rank 0) alone reads the tokenizers' PULL socket and decides everything. What
the other ranks must do, it publishes on a ZeroMQ PUB socket: step plans (`StepPlan`), a `Tick`
while idle, `ReportReq` and `Shutdown`. Every other rank reads them from a SUB socket in order.
Publishing is not a collective: the leader never waits for a slow stage, and a stage waits only
for the plan it runs next, at most `--dist-timeout`.

Sockets are one machine's ipc paths, or TCP on node 0 when ranks span machines: then CURVE
channels that only this deployment's processes can join (ipc/secure.py). The sampling rank
(last stage, tensor rank 0) and each later stage's tensor rank 0 send results and traffic
counts back to the leader on a PUSH socket (`Endpoints.results`).
"""

from __future__ import annotations

import time

import torch
import zmq

from shardserve.distributed.communicator import CollectiveError, Communicator
from shardserve.ipc.messages import Msg, decode_or_none, encode
from shardserve.ipc.messages.plan import Tick
from shardserve.ipc.sockets import bound, connected, gate_for, recv_all

SYNC = b"\x00sync"  # published at start-up until every subscriber has seen one; never counted
TICK_INTERVAL = 1.0  # seconds between Ticks while the leader publishes nothing else


class Inbox:
    """The leader's side: requests in, plans out, results back."""

    def __init__(self, ctx: zmq.Context, pull_addr: str, fanout_addr: str, results_addr: str | None,
                 control: Communicator, timeout_s: float, secret: bytes = b""):
        """`results_addr` only with several pipeline stages (None: results are computed here);
        `secret` keys the TCP channels."""
        self.control = control
        many = control.size > 1
        # One ZAP handler for every TCP channel this process binds (ipc/sockets.gate_for).
        self.gate = gate_for(ctx, secret, pull_addr, *([fanout_addr] if many else []),
                             *([results_addr] if many and results_addr else []))
        self.pull = bound(ctx, zmq.PULL, pull_addr, secret, self.gate, "the scheduler's inbox")
        self.pub = self.results = None
        self.last_publish = time.monotonic()
        if many:
            self.pub = bound(ctx, zmq.PUB, fanout_addr, secret, self.gate, "the plan feed")
            self.pub.setsockopt(zmq.SNDHWM, 0)
            if results_addr is not None:
                self.results = bound(ctx, zmq.PULL, results_addr, secret, self.gate, "the results inbox")
            _sync(control, timeout_s, self._send_sync, again=True)

    def _send_sync(self) -> bool:
        self.pub.send(SYNC)
        return True

    def receive(self, wait_ms: int, results_too: bool = False, also: list[zmq.Socket] = ()) -> list[Msg]:
        """This step's messages; waits up to `wait_ms` for the first one (or, with `results_too`,
        until a result is ready to collect, or until one of `also` has something: the
        disaggregation channels, which their owners read)."""
        if wait_ms:
            poller = zmq.Poller()
            poller.register(self.pull, zmq.POLLIN)
            if results_too and self.results is not None:
                poller.register(self.results, zmq.POLLIN)
            for sock in also:
                poller.register(sock, zmq.POLLIN)
            poller.poll(wait_ms)
        return recv_all(self.pull, "the scheduler's inbox")

    def publish(self, msg: Msg) -> None:
        """Send `msg` to every other rank of the replica, counted on the control group."""
        if self.pub is None:
            return
        data = encode(msg)
        self.control.count("plan_fanout", len(data))
        self.pub.send(data, copy=False)
        self.last_publish = time.monotonic()

    def tick(self) -> None:
        if self.pub is not None and time.monotonic() - self.last_publish > TICK_INTERVAL:
            self.publish(Tick())

    def take_results(self, timeout_ms: int) -> list[Msg]:
        """Results and stage traffic that arrived, waiting up to `timeout_ms` for the first."""
        if self.results is None or (timeout_ms and not self.results.poll(timeout_ms)):
            return []
        return recv_all(self.results, "the results inbox")


class Feed:
    """Every other rank's side: the leader's messages, in order."""

    def __init__(self, ctx: zmq.Context, fanout_addr: str, control: Communicator, timeout_s: float,
                 secret: bytes = b""):
        self.rank = control.members[control.rank]
        self.leader = control.members[0]
        self.timeout_ms = int(timeout_s * 1000)
        self.sub = connected(ctx, zmq.SUB, fanout_addr, secret)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        _sync(control, timeout_s, self._saw_sync)

    def _saw_sync(self) -> bool:
        return bool(self.sub.poll(50)) and self.sub.recv() == SYNC

    def next(self) -> Msg:
        while True:
            if not self.sub.poll(self.timeout_ms):
                raise CollectiveError(f"rank {self.rank}: nothing from the leader (rank {self.leader}) on the plan "
                                      f"feed within {self.timeout_ms / 1000:.0f} s")
            data = self.sub.recv()
            if data != SYNC and (msg := decode_or_none(data, "the plan feed")) is not None:
                return msg


def _sync(control: Communicator, timeout_s: float, attempt, again: bool = False) -> None:
    """ZeroMQ drops what a PUB sends before a SUB has joined: the leader publishes SYNC (`again`:
    every round) until every subscriber has seen one (agreed over the control group, at start-up
    only)."""
    deadline = time.monotonic() + timeout_s
    flag = torch.zeros(1, dtype=torch.int32)
    while True:
        if again or not flag[0]:
            flag[0] = int(attempt())
        agreed = control.all_reduce(flag.clone(), op="min")
        if agreed[0]:
            return
        if time.monotonic() > deadline:
            raise CollectiveError(f"rank {control.members[control.rank]}: subscribers did not join the plan feed "
                                  f"in time")
        time.sleep(0.02)
