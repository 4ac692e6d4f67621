"""The TCP channels between our processes admit only holders of the deployment secret (CURVE), a
malformed message is dropped with a log line, and the ipc directory is private to its user."""

from __future__ import annotations

import os
import socket
import stat
import time

import pytest
import zmq

from shardserve.ipc.messages import decode_or_none, encode
from shardserve.ipc.messages.plan import Tick
from shardserve.ipc.secure import SecretError, deployment_secret
from shardserve.ipc.sockets import Endpoints, recv_all
from shardserve.scheduler.inbox import _bound, connected


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_only_the_deployment_secret_gets_a_message_through(caplog):
    from shardserve.ipc.secure import Gate, _keys

    ctx = zmq.Context()
    addr = f"tcp://127.0.0.1:{free_port()}"
    gate = Gate(ctx, b"the-right-secret-0123456789")
    inbox = _bound(ctx, zmq.PULL, addr, b"the-right-secret-0123456789", gate, "the test channel")
    try:
        plain = ctx.socket(zmq.PUSH)  # no CURVE at all
        plain.connect(addr)
        wrong = connected(ctx, zmq.PUSH, addr, b"another-secret-0123456789")
        # Knows the server's public key (say it leaked) but holds its own key pair: the Gate refuses it.
        leaked = ctx.socket(zmq.PUSH)
        leaked.curve_serverkey = _keys(b"the-right-secret-0123456789")[0]
        leaked.curve_publickey, leaked.curve_secretkey = zmq.curve_keypair()
        leaked.connect(addr)
        right = connected(ctx, zmq.PUSH, addr, b"the-right-secret-0123456789")
        for sock in (plain, wrong, leaked, right):
            sock.setsockopt(zmq.LINGER, 0)
            sock.send(encode(Tick()), zmq.NOBLOCK)
        got = []
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            inbox.poll(200)
            got += recv_all(inbox, "test")
        time.sleep(0.5)  # a forged frame, had it passed, would have arrived by now too
        got += recv_all(inbox, "test")
        assert got == [Tick()]
        assert len(gate.refused) == 1  # the leaked-server-key peer, refused by the Gate (and logged once)
        assert gate.failed_handshakes >= 2  # the plain socket and the wrong secret, at the handshake
        assert caplog.text.count("refused a peer on the test channel") == 1
        for sock in (plain, wrong, leaked, right):
            sock.close()
    finally:
        inbox.close(0)
        gate.stop()
        ctx.term()


def test_a_tcp_channel_without_a_secret_is_refused():
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="no deployment secret"):
            _bound(ctx, zmq.PULL, f"tcp://127.0.0.1:{free_port()}", b"")
    finally:
        ctx.term()


def test_malformed_messages_are_dropped_not_raised(caplog):
    assert decode_or_none(b"\xff\x00 not a message", "the plan feed") is None
    assert "dropped a malformed 16-byte message on the plan feed" in caplog.text


def test_secret_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("SHARDSERVE_DIST_SECRET", raising=False)
    path = str(tmp_path / "secret")
    with pytest.raises(SecretError, match="does not exist"):
        deployment_secret(path, create=False)  # another node: never invents one
    made = deployment_secret(path, create=True)  # node 0: writes a fresh one, private
    assert len(made) == 64 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert deployment_secret(path, create=False) == made
    monkeypatch.setenv("SHARDSERVE_DIST_SECRET", "from-the-environment")
    assert deployment_secret(path, create=False) == b"from-the-environment"
    assert deployment_secret(None, create=True) == b"from-the-environment"
    assert "from-the-environment" not in repr(Endpoints.create(1, secret=b"from-the-environment"))


def test_ipc_directory_is_private():
    ep = Endpoints.create(1)
    try:
        assert stat.S_IMODE(os.stat(ep.root).st_mode) == 0o700
    finally:
        os.rmdir(ep.root)


def test_several_nodes_need_a_secret():
    from shardserve.distributed.layout import Layout, LayoutError
    from shardserve.launch.nodes import NodeSpec

    with pytest.raises(LayoutError, match="--nnodes 2 needs a deployment secret on every node"):
        NodeSpec(0, "127.0.0.1:29500").check(Layout(tp=2, nnodes=2))
    NodeSpec(0, "127.0.0.1:29500", b"a-secret-of-enough-length").check(Layout(tp=2, nnodes=2))
