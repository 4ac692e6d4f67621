"""A malformed frame on any of our channels is logged (one line, naming the channel) and dropped:
the message after it still arrives, and nothing that reads the channel stops."""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import pytest
import zmq

from shardserve.ipc.messages import encode
from shardserve.ipc.messages.api import AbortReq, ErrorOut, TextBatch, TextOut, TokenizeReq
from shardserve.ipc.messages.lifecycle import Shutdown
from shardserve.ipc.sockets import Endpoints, pull, push, recv, recv_all
from shardserve.server.client import EngineClient

BAD = b"\xff\x00 not a message"


@pytest.fixture
def ep():
    ep = Endpoints.create(1)
    yield ep
    for name in os.listdir(ep.root):
        os.unlink(os.path.join(ep.root, name))
    os.rmdir(ep.root)


@pytest.fixture
def pair(ep):
    """A bound PULL socket (at the scheduler's address) and a PUSH socket connected to it."""
    ctx = zmq.Context()
    inbox, out = pull(ctx, ep.scheduler), push(ctx, ep.scheduler)
    yield inbox, out
    out.close(0)
    inbox.close(0)
    ctx.term()


def dropped(caplog, where: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("dropped a malformed") and where in r.getMessage()]


def test_recv_drops_a_malformed_frame_and_names_the_channel(pair, caplog):
    inbox, out = pair
    out.send(BAD)
    out.send(encode(AbortReq(rid="after the bad one")))
    # Blocking: the bad frame is skipped, the good one returned.
    assert recv(inbox, where="the test channel") == AbortReq(rid="after the bad one")
    assert len(dropped(caplog, "the test channel")) == 1
    # Polling: the bad frame reads as nothing yet, and the next call gets the good one.
    out.send(BAD)
    out.send(encode(AbortReq(rid="next")))
    assert recv(inbox, timeout_ms=10_000) is None
    assert recv(inbox, timeout_ms=10_000) == AbortReq(rid="next")
    # Without a name the log line gives the socket's address.
    assert len(dropped(caplog, inbox.getsockopt_string(zmq.LAST_ENDPOINT))) == 1


def test_recv_all_drops_a_malformed_frame_and_keeps_the_rest(pair, caplog):
    inbox, out = pair
    for msg in (encode(AbortReq(rid="a")), BAD, encode(AbortReq(rid="b"))):
        out.send(msg)
    got: list = []
    while len(got) < 2:
        assert inbox.poll(10_000), f"only {got} arrived"
        got += recv_all(inbox)  # no name: the socket's address
    assert got == [AbortReq(rid="a"), AbortReq(rid="b")]
    assert len(dropped(caplog, inbox.getsockopt_string(zmq.LAST_ENDPOINT))) == 1


def test_the_tokenizer_loop_skips_a_malformed_frame(ep, caplog):
    from shardserve.tokenizer.worker import _serve

    ctx = zmq.Context()
    inbox, out = pull(ctx, ep.tokenizer(0)), push(ctx, ep.tokenizer(0))
    seen: list = []
    loop = threading.Thread(target=_serve, args=({inbox: seen.append},), daemon=True)
    loop.start()
    try:
        for data in (BAD, encode(TokenizeReq(rid="t", text="hi")), encode(Shutdown())):
            out.send(data)
        loop.join(30)
        assert not loop.is_alive(), "the loop never reached the Shutdown after the bad frame"
        assert seen == [TokenizeReq(rid="t", text="hi")]
        assert len(dropped(caplog, ep.tokenizer(0))) == 1
    finally:
        out.close(0)
        inbox.close(0)
        ctx.term()


def text(rid: str) -> TextBatch:
    return TextBatch(items=[TextOut(rid=rid, text="x", new_ids=[1], finished=False)])


async def _client_run(ep: Endpoints, body) -> None:
    client = EngineClient(ep, 1)
    ctx = zmq.Context()
    engine = push(ctx, ep.api)  # what the detokenizer and the schedulers send on
    try:
        client.start()
        await body(client, engine)
    finally:
        client._task.cancel()
        await asyncio.gather(client._task, return_exceptions=True)
        engine.close(0)
        ctx.term()
        client.close()


def test_the_api_inbox_survives_a_malformed_frame(ep, caplog):
    async def body(client, engine):
        q: asyncio.Queue = asyncio.Queue()
        client.queues["r1"] = q
        engine.send(BAD)
        engine.send(encode(text("r1")))
        assert await asyncio.wait_for(q.get(), 30) == text("r1").items[0]
        assert not client._task.done()

    with caplog.at_level(logging.WARNING):
        asyncio.run(_client_run(ep, body))
    lines = dropped(caplog, "the API process's inbox")
    assert len(lines) == 1 and ep.api in lines[0]


def test_the_api_inbox_survives_a_message_it_cannot_route(ep, caplog, monkeypatch):
    async def body(client, engine):
        real = client._deliver
        calls = []

        def deliver(rid, item):
            calls.append(rid)
            if len(calls) == 1:
                raise RuntimeError("a routing bug")
            real(rid, item)

        monkeypatch.setattr(client, "_deliver", deliver)
        q: asyncio.Queue = asyncio.Queue()
        client.queues["r1"] = q
        engine.send(encode(text("r1")))
        engine.send(encode(text("r1")))
        assert await asyncio.wait_for(q.get(), 30) == text("r1").items[0]
        assert calls == ["r1", "r1"] and not client._task.done()

    asyncio.run(_client_run(ep, body))
    assert "dropped a TextBatch on the API process's inbox" in caplog.text
    assert "a routing bug" in caplog.text


def test_the_api_inbox_fails_every_waiter_if_it_stops(ep, caplog, monkeypatch):
    """Should the routing task ever end, every waiter is told at once (not left to time out),
    and new requests are refused."""
    from shardserve.server.errors import APIError

    async def body(client, engine):
        q: asyncio.Queue = asyncio.Queue()
        client.queues["r1"] = q
        client._task.cancel()  # replace the router by one whose socket breaks
        await asyncio.gather(client._task, return_exceptions=True)

        async def broken():
            raise zmq.ZMQError(zmq.ENOTSOCK)

        monkeypatch.setattr(client.inbox, "recv", broken)
        client.start()
        err = await asyncio.wait_for(q.get(), 30)
        assert isinstance(err, ErrorOut) and err.rid == "r1" and err.status == 500
        assert "stopped reading engine replies" in err.message
        with pytest.raises(APIError):
            await client.submit(None, asyncio.Queue())

    asyncio.run(_client_run(ep, body))
    assert "the API process stopped reading the API process's inbox" in caplog.text
