"""The API process's side of the pipes: submit requests, route every reply to its waiter."""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid

import zmq
import zmq.asyncio

from shardserve.ipc.messages import Msg, decode_or_none, encode
from shardserve.ipc.messages.api import AbortReq, DetokenizeOut, ErrorOut, GenerateReq, TextBatch, TokenizeOut
from shardserve.ipc.messages.reports import RouterStats, Stats
from shardserve.ipc.sockets import Endpoints
from shardserve.server.errors import APIError

log = logging.getLogger(__name__)


class EngineClient:
    """Every generate sub-request has a queue its TextOut / ErrorOut items arrive on."""

    def __init__(self, ep: Endpoints, num_tokenizer_sockets: int):
        self.ctx = zmq.asyncio.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(ep.api)
        self._inbox_name = f"the API process's inbox ({ep.api})"
        self.tokenizers = []
        for i in range(num_tokenizer_sockets):
            s = self.ctx.socket(zmq.PUSH)
            s.connect(ep.tokenizer(i))
            self.tokenizers.append(s)
        self.scheduler = self.ctx.socket(zmq.PUSH)
        self.scheduler.connect(ep.scheduler)
        self._rr = itertools.cycle(range(num_tokenizer_sockets))
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats: dict[int, Stats] = {}  # by replica
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
            self.stats[msg.replica] = msg
        elif isinstance(msg, RouterStats):
            self.router_stats = msg

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
        q = self.queues.get(rid)
        if q is not None:
            q.put_nowait(item)

    @staticmethod
    def new_rid() -> str:
        return uuid.uuid4().hex

    async def _send_tokenizer(self, msg: Msg) -> None:
        await self.tokenizers[next(self._rr)].send(encode(msg))

    async def submit(self, req: GenerateReq, queue: asyncio.Queue) -> None:
        if self.dead:
            raise APIError(503, self.dead)
        self.queues[req.rid] = queue
        await self._send_tokenizer(req)

    def release(self, rid: str) -> None:
        self.queues.pop(rid, None)

    async def abort(self, rid: str) -> None:
        self.queues.pop(rid, None)
        await self.scheduler.send(encode(AbortReq(rid=rid)))

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
        self.queues.clear()
        return cut

    def close(self) -> None:
        """Drop unsent messages (aborts towards stopped workers) rather than wait to deliver them."""
        for s in (self.inbox, self.scheduler, *self.tokenizers):
            s.close(linger=0)
        self.ctx.term()

    @property
    def num_active(self) -> int:
        return len(self.queues)
