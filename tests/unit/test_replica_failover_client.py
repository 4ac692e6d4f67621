"""The API process's side of a replica's death (server/client.py): a request whose client has
seen nothing is sent again under a new id and its waiter sees only its own id; the dead
replica's late output is dropped; a stream that already sent text ends with a 503 naming the
replica; a whole answer being collected forgets what it had (Rewind) and is generated again."""

from __future__ import annotations

import asyncio

import zmq

from shardserve.ipc.messages import decode
from shardserve.ipc.messages.api import ErrorOut, GenerateReq, TextBatch, TextOut
from shardserve.ipc.messages.replicas import ReplicaLost
from shardserve.ipc.sockets import Endpoints
from shardserve.sampling_params import SamplingParams
from shardserve.server.client import EngineClient, Rewind


async def within(awaitable, what: str = "the client's send"):
    """Await with a bound: a regression fails here instead of hanging the suite."""
    try:
        return await asyncio.wait_for(awaitable, 10)
    except asyncio.TimeoutError:
        raise AssertionError(f"nothing came within 10 s: {what}") from None


def wired() -> tuple[EngineClient, zmq.asyncio.Socket]:
    """An API-process client of two replicas, and the tokenizer socket it sends to."""
    ep = Endpoints.create(1, dp=2)
    tokenizer = zmq.asyncio.Context.instance().socket(zmq.PULL)
    tokenizer.bind(ep.tokenizer(0))
    return EngineClient(ep, 1), tokenizer


def unwire(client: EngineClient, tokenizer: zmq.asyncio.Socket) -> None:
    tokenizer.close(linger=0)
    client.close()


def out(rid: str, text: str, finished: bool = False) -> TextBatch:
    return TextBatch(items=[TextOut(rid=rid, text=text, new_ids=[1], finished=finished)])


def test_requests_of_a_dead_replica_are_sent_again_or_cut_off():
    async def run():
        client, tokenizer = wired()
        queues = {rid: asyncio.Queue() for rid in ("quiet", "streamed", "collected")}
        for rid, q in queues.items():
            await client.submit(GenerateReq(rid=rid, params=SamplingParams(max_tokens=4), text="hi"), q,
                                replayable=rid == "collected")
        sent = [decode(await within(tokenizer.recv())).rid for _ in range(3)]
        assert sorted(sent) == ["collected", "quiet", "streamed"]
        client._dispatch(out("streamed", "a"))
        client._dispatch(out("collected", "b"))
        client._dispatch(ReplicaLost(replica=1, rids=["quiet", "streamed", "collected", "gone"], reason="killed"))
        again = {decode(await within(tokenizer.recv())).rid for _ in range(2)}
        assert len(again) == 2 and not again & {"quiet", "collected"}  # new ids
        assert client.board.replicas[1].placed_again == 2 and client.board.replicas[1].cut_off == 1

        s = queues["streamed"]
        assert (await within(s.get())).text == "a"
        err = await within(s.get())
        assert isinstance(err, ErrorOut) and err.status == 503
        assert err.message == "replica 1 stopped while this request was running: killed"
        c = queues["collected"]
        assert (await within(c.get())).text == "b" and await within(c.get()) == Rewind("collected")

        # The dead replica's late output under the old id is dropped; the new run's is delivered
        # under the request's own id.
        client._dispatch(out("quiet", "late"))
        new_quiet = client.current["quiet"]
        client._dispatch(out(new_quiet, "fresh", finished=True))
        got = await within(queues["quiet"].get())
        assert got.rid == "quiet" and got.text == "fresh" and queues["quiet"].empty()
        client.release("quiet")
        assert new_quiet not in client.alias and "quiet" not in client.current
        unwire(client, tokenizer)

    asyncio.run(run())


def test_an_answer_finished_before_its_replica_died_is_not_sent_again():
    """Its last output is queued, unread, when the replica's loss arrives: it stays finished."""
    async def run():
        client, tokenizer = wired()
        q: asyncio.Queue = asyncio.Queue()
        await client.submit(GenerateReq(rid="done", params=SamplingParams(max_tokens=4), text="hi"), q,
                            replayable=True)
        assert decode(await within(tokenizer.recv())).rid == "done"
        client._dispatch(out("done", "all of it", finished=True))
        client._dispatch(ReplicaLost(replica=0, rids=["done"], reason="killed"))
        assert client.board.replicas[0].placed_again == 0 and "done" not in client.current
        assert (await within(q.get())).finished and q.empty()  # no Rewind after the finish
        assert not await tokenizer.poll(200)  # and nothing sent again
        client.release("done")
        assert "done" not in client.finished
        unwire(client, tokenizer)

    asyncio.run(run())


def test_a_dropped_stream_is_not_started_again_by_its_late_tokens(monkeypatch):
    from shardserve.ipc.messages.api import TokenOut
    from shardserve.tokenizer import detokenizer
    from shardserve.tokenizer.detokenizer import Detokenizer

    detok = Detokenizer(None)
    detok.feed(TokenOut(rid="a", new_ids=[1], finished=False))
    detok.drop("a")  # its replica died (DropStreams)
    assert not detok.live(TokenOut(rid="a", new_ids=[2], finished=False)) and "a" not in detok.streams
    assert detok.live(TokenOut(rid="b", new_ids=[2], finished=False))
    monkeypatch.setattr(detokenizer, "DROPPED_KEPT", 2)
    for rid in ("x", "y", "z"):
        detok.drop(rid)
    assert list(detok.dropped) == ["y", "z"]  # bounded: the oldest forgotten first


def test_totals_do_not_fall_when_a_replica_starts_again_from_zero():
    from shardserve.ipc.messages.reports import Stats
    from shardserve.server.metrics import Metrics

    def stats(replica: int, finished: int, steps: int, running: int) -> Stats:
        return Stats(running=running, waiting=0, pages_used=running, pages_total=8, prefix_hit_rate=0.0,
                     finished=finished, steps=steps, replica=replica)

    def total(metrics: Metrics, name: str) -> float:
        return metrics.registry.get_sample_value(name)

    async def run():
        client, tokenizer = wired()
        client._dispatch(stats(0, finished=5, steps=50, running=1))
        client._dispatch(stats(1, finished=10, steps=70, running=2))
        client.replicas_down((1,), "killed")
        client._dispatch(stats(1, finished=11, steps=71, running=2))  # the dead leader's last, late
        assert 1 not in client.stats
        client.replicas_up((1,), 1)
        client._dispatch(stats(1, finished=2, steps=4, running=1))  # the new leader counts from zero
        m = Metrics()
        m.update(client.stats, None, client.board, client.retired)
        assert total(m, "shardserve_engine_requests_finished") == 5 + 10 + 2
        assert total(m, "shardserve_engine_steps") == 50 + 70 + 4
        assert total(m, "shardserve_num_requests_running") == 1 + 1  # what the dead one ran is gone
        assert total(m, "shardserve_kv_pages_total") == 16
        unwire(client, tokenizer)

    asyncio.run(run())


def test_a_request_sent_again_is_aborted_under_its_new_id_after_shutdown():
    """fail_all (the server stopping) ends every waiter; each waiter's abort must still name the
    id its request runs under since it was sent again, not the old id its replica no longer has."""

    async def run():
        client, tokenizer = wired()
        scheduler = zmq.asyncio.Context.instance().socket(zmq.PULL)
        scheduler.bind(client.scheduler.getsockopt_string(zmq.LAST_ENDPOINT))
        await client.submit(GenerateReq(rid="r", params=SamplingParams(max_tokens=4), text="hi"), asyncio.Queue())
        await within(tokenizer.recv())
        client._dispatch(ReplicaLost(replica=1, rids=["r"], reason="killed"))
        new = decode(await within(tokenizer.recv())).rid
        assert new != "r"
        client.fail_all("the server is shutting down", status=503)
        await client.abort("r")
        assert decode(await within(scheduler.recv(), "the abort")).rid == new
        scheduler.close(linger=0)
        unwire(client, tokenizer)

    asyncio.run(run())
