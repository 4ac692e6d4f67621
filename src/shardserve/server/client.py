"""The API process's side of the pipes: submit requests, route every reply to its waiter.

With several replicas, a replica that dies hands back the requests placed on it (`ReplicaLost`
from the router): one whose client has seen nothing yet (no output, or a `replayable` one: a
whole answer collected before it is sent) is sent again under a new id, its late output from the
dead replica dropped and its waiter told to forget what it collected (`Rewind`); one that has
streamed to its client ends with a 503 naming the cause.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from shardserve.ipc.messages import Msg, decode_or_none, encode
from shardserve.ipc.messages.api import (
    AbortReq,
    DetokenizeOut,
    ErrorOut,
    GenerateReq,
    TextBatch,
    TextOut,
    TokenizeOut,
)
from shardserve.ipc.messages.replicas import ReplicaDown, ReplicaLost, ReplicaUp
from shardserve.ipc.messages.reports import RouterStats, Stats, merge_stats
from shardserve.ipc.sockets import Endpoints, bound, connected, gate_for
from shardserve.server.errors import APIError
from shardserve.server.replica_board import ReplicaBoard

RETIRED = 1 << 30  # the replica number of what dead replicas counted (never the first in merge_stats)

log = logging.getLogger(__name__)


@dataclass
class Rewind:
    """Queue item: the request's output so far is void; it is being generated again."""

    rid: str


class EngineClient:
    """Every generate sub-request has a queue its TextOut / ErrorOut items arrive on."""

    def __init__(self, ep: Endpoints, num_tokenizer_sockets: int):
        self.ctx = zmq.asyncio.Context()
        # Leaders placed by Ray on other machines send here over TCP: the ZAP handler runs on a
        # plain (not asyncio) context over the same one underneath.
        self.gate = gate_for(zmq.Context.shadow(self.ctx.underlying), ep.secret, ep.api)
        self.inbox = bound(self.ctx, zmq.PULL, ep.api, ep.secret)
        self._inbox_name = f"the API process's inbox ({ep.api})"
        self.tokenizers = []
        for i in range(num_tokenizer_sockets):
            s = self.ctx.socket(zmq.PUSH)
            s.connect(ep.tokenizer(i))
            self.tokenizers.append(s)
        self.scheduler = connected(self.ctx, zmq.PUSH, ep.scheduler, ep.secret)
        self._rr = itertools.cycle(range(num_tokenizer_sockets))
        self.queues: dict[str, asyncio.Queue] = {}
        self.reqs: dict[str, GenerateReq] = {}  # by rid: to send again should its replica die
        self.started: set[str] = set()  # rids that have had output
        self.replayable: set[str] = set()  # rids whose client sees nothing until the end
        self.finished: set[str] = set()  # rids whose last output is queued, not yet read
        self.current: dict[str, str] = {}  # rid -> the id it runs under since it was sent again
        self.alias: dict[str, str] = {}  # ... and back
        self.board = ReplicaBoard(ep.dp)
        self._tasks: set[asyncio.Task] = set()
        self.stats: dict[int, Stats] = {}  # by replica
        self.retired: Stats | None = None  # what replicas that died had counted (their counts go on)
        self.router_stats: RouterStats | None = None
        self.dead: str | None = None  # set when a worker died: the reason
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._route())
        self._task.add_done_callback(self._route_ended)

    async def _route(self) -> None:
        while True:
            data = await self.inbox.recv()
            msg = decode_or_none(data, self._inbox_name)  # malformed: logged and dropped
            if msg is None:
                continue
            try:
                self._dispatch(msg)
            except Exception:  # one bad message must not end the routing of every later one
                log.exception("dropped a %s on %s that could not be routed", type(msg).__name__, self._inbox_name)

    def _dispatch(self, msg: Msg) -> None:
        if isinstance(msg, TextBatch):
            for item in msg.items:
                self._deliver(item.rid, item)
        elif isinstance(msg, ErrorOut | TokenizeOut | DetokenizeOut):
            self._deliver(msg.rid, msg)
        elif isinstance(msg, Stats):
            # A dead replica's last reports can still be on the way: its counts are retired already.
            if msg.replica >= len(self.board.replicas) or self.board.replicas[msg.replica].state == "serving":
                self.stats[msg.replica] = msg
        elif isinstance(msg, RouterStats):
            self.router_stats = msg
        elif isinstance(msg, ReplicaLost):
            self._lost(msg)

    def _route_ended(self, task: asyncio.Task) -> None:
        """Nothing awaits the routing task: if it ever ends other than by cancellation (the
        socket closed, a bug), say so and fail every waiter now instead of letting each one
        wait out its timeout."""
        if task.cancelled():
            return
        err = task.exception()
        log.error("the API process stopped reading %s: %r", self._inbox_name, err, exc_info=err)
        # The client's one line names no class (the log above has the traceback).
        self.fail_all(f"the API process stopped reading engine replies: {err or 'the reader ended'}", status=500)

    def _deliver(self, rid: str, item: Msg) -> None:
        own = self.alias.get(rid)
        if own is not None:
            item.rid = own  # sent again under another id: the waiter knows only its own
        elif rid in self.current:
            return  # the first run's output, from a replica that has died since
        else:
            own = rid
        q = self.queues.get(own)
        if q is not None:
            if isinstance(item, TextOut):
                self.started.add(own)
                if item.finished:
                    self.finished.add(own)
            q.put_nowait(item)

    def _lost(self, msg: ReplicaLost) -> None:
        """Replica `msg.replica` died holding `msg.rids` (module docstring)."""
        again = cut = 0
        for rid in msg.rids:
            own = self.alias.get(rid, rid)
            if self.current.get(own, own) != rid or own not in self.queues or own in self.finished:
                continue  # finished, aborted, or already sent again
            if (own in self.started and own not in self.replayable) or own not in self.reqs:
                self.queues[own].put_nowait(ErrorOut(rid=own, status=503, message=(
                    f"replica {msg.replica} stopped while this request was running: {msg.reason}")))
                cut += 1
                continue
            if own in self.started:
                self.started.discard(own)
                self.queues[own].put_nowait(Rewind(own))
            new = self.new_rid()
            self.alias.pop(rid, None)
            self.alias[new], self.current[own] = own, new
            self._spawn(self._send_tokenizer(msgspec.structs.replace(self.reqs[own], rid=new)))
            again += 1
        status = self.board.replicas[msg.replica]
        status.placed_again += again
        status.cut_off += cut
        log.warning("replica %d died holding %d request%s: %d sent to another replica, %d cut off mid-stream",
                    msg.replica, again + cut, "" if again + cut == 1 else "s", again, cut)

    def _spawn(self, awaitable) -> None:
        """Run a send without waiting for it (a zmq.asyncio send is a future, not a coroutine)."""
        task = asyncio.ensure_future(awaitable)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def replicas_down(self, replicas: tuple[int, ...], reason: str) -> None:
        """The supervisor saw `replicas` die: the router must stop placing there and hand back
        what they held (on the event loop's thread)."""
        self.board.down(replicas, reason)
        for d in replicas:
            last = self.stats.pop(d, None)
            if last is not None:
                self.retire(last)
        self._spawn(self.scheduler.send(encode(ReplicaDown(replicas=list(replicas), reason=reason))))

    def retire(self, last: Stats) -> None:
        """Keep a dead replica's running totals (steps, finished, prefix tokens, routing counts), so that
        /metrics' totals never fall when it starts again from zero; what it ran is gone."""
        done = msgspec.structs.replace(last, running=0, waiting=0, pages_used=0, pages_total=0, traffic={},
                                       control={}, stages={}, replica=RETIRED)
        self.retired = done if self.retired is None else merge_stats([self.retired, done])

    def replicas_up(self, replicas: tuple[int, ...], restarts: int) -> None:
        self.board.up(replicas, restarts)
        self._spawn(self.scheduler.send(encode(ReplicaUp(replicas=list(replicas)))))

    @staticmethod
    def new_rid() -> str:
        return uuid.uuid4().hex

    async def _send_tokenizer(self, msg: Msg) -> None:
        await self.tokenizers[next(self._rr)].send(encode(msg))

    async def submit(self, req: GenerateReq, queue: asyncio.Queue, replayable: bool = False) -> None:
        """`replayable`: the caller sends its client nothing before the end, so the request can
        be generated again from the start should its replica die (the caller handles `Rewind`)."""
        if self.dead:
            raise APIError(503, self.dead)
        self.queues[req.rid] = queue
        self.reqs[req.rid] = req
        if replayable:
            self.replayable.add(req.rid)
        await self._send_tokenizer(req)

    def release(self, rid: str) -> str:
        """Forget `rid`; returns the id it runs under (itself unless it was sent again)."""
        self.queues.pop(rid, None)
        self.reqs.pop(rid, None)
        self.started.discard(rid)
        self.replayable.discard(rid)
        self.finished.discard(rid)
        running = self.current.pop(rid, rid)
        self.alias.pop(running, None)
        return running

    async def abort(self, rid: str) -> None:
        await self.scheduler.send(encode(AbortReq(rid=self.release(rid))))

    async def call(self, msg: Msg, timeout: float = 60.0) -> Msg:
        """A request with one reply (tokenize, detokenize)."""
        q: asyncio.Queue = asyncio.Queue()
        self.queues[msg.rid] = q
        try:
            await self._send_tokenizer(msg)
            return await asyncio.wait_for(q.get(), timeout)
        finally:
            self.queues.pop(msg.rid, None)

    def fail_all(self, reason: str, status: int = 500) -> int:
        """A worker died, or the server is stopping: every waiter gets an error now rather than
        hanging, and nothing new is taken. Returns how many HTTP requests were cut off (their
        sub-requests share one queue)."""
        self.dead = reason
        for rid, q in list(self.queues.items()):
            q.put_nowait(ErrorOut(rid=rid, message=reason, status=status))
        cut = len({id(q) for q in self.queues.values()})
        # `current`/`alias` stay: each waiter's abort (its finally) still needs the id its request
        # runs under since it was sent again, and `release` forgets the pair then.
        for state in (self.queues, self.reqs, self.started, self.replayable):
            state.clear()
        return cut

    def close(self) -> None:
        """Drop unsent messages (aborts towards stopped workers) rather than wait to deliver them."""
        for s in (self.inbox, self.scheduler, *self.tokenizers):
            s.close(linger=0)
        if self.gate is not None:
            self.gate.stop()
        self.ctx.term()

    @property
    def num_active(self) -> int:
        return len(self.queues)
