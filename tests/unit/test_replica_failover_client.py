"""The API process's side of a replica's death (server/client.py): a request whose client has
seen nothing is sent again under a new id and its waiter sees only its own id; the dead
replica's late output is dropped; a stream that already sent text ends with a 503 naming the
replica; a whole answer being collected forgets what it had (Rewind) and is generated again."""

from __future__ import annotations

import asyncio

import zmq

from shardserve.core import SamplingParams
from shardserve.ipc.messages import decode
from shardserve.ipc.messages.api import ErrorOut, GenerateReq, TextBatch, TextOut
from shardserve.ipc.messages.replicas import ReplicaLost
from shardserve.ipc.sockets import Endpoints
from shardserve.server.client import EngineClient, Rewind


def out(rid: str, text: str, finished: bool = False) -> TextBatch:
    return TextBatch(items=[TextOut(rid=rid, text=text, new_ids=[1], finished=finished)])


def test_requests_of_a_dead_replica_are_sent_again_or_cut_off():
    async def run():
        ep = Endpoints.create(1, dp=2)
        ctx = zmq.asyncio.Context()
        tokenizer = ctx.socket(zmq.PULL)
        tokenizer.bind(ep.tokenizer(0))
        client = EngineClient(ep, 1)
        queues = {rid: asyncio.Queue() for rid in ("quiet", "streamed", "collected")}
        for rid, q in queues.items():
            await client.submit(GenerateReq(rid=rid, params=SamplingParams(max_tokens=4), text="hi"), q,
                                replayable=rid == "collected")
        sent = [decode(await tokenizer.recv()).rid for _ in range(3)]
        assert sorted(sent) == ["collected", "quiet", "streamed"]
        client._dispatch(out("streamed", "a"))
        client._dispatch(out("collected", "b"))
        client._dispatch(ReplicaLost(replica=1, rids=["quiet", "streamed", "collected", "gone"], reason="killed"))
        again = {decode(await tokenizer.recv()).rid for _ in range(2)}
        assert len(again) == 2 and not again & {"quiet", "collected"}  # new ids
        assert client.board.replicas[1].placed_again == 2 and client.board.replicas[1].cut_off == 1

        s = queues["streamed"]
        assert (await s.get()).text == "a"
        err = await s.get()
        assert isinstance(err, ErrorOut) and err.status == 503
        assert err.message == "replica 1 stopped while this request was running: killed"
        c = queues["collected"]
        assert (await c.get()).text == "b" and await c.get() == Rewind("collected")

        # The dead replica's late output under the old id is dropped; the new run's is delivered
        # under the request's own id.
        client._dispatch(out("quiet", "late"))
        new_quiet = client.current["quiet"]
        client._dispatch(out(new_quiet, "fresh", finished=True))
        got = await queues["quiet"].get()
        assert got.rid == "quiet" and got.text == "fresh" and queues["quiet"].empty()
        client.release("quiet")
        assert new_quiet not in client.alias and "quiet" not in client.current
        tokenizer.close(linger=0)
        ctx.term()
        client.close()

    asyncio.run(run())
