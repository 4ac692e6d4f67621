"""The TCP channels between our processes admit only holders of the deployment secret (CURVE), a
malformed message is dropped with a log line, and the ipc directory is private to its user."""

from __future__ import annotations

import os
import socket
import stat
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from shardserve.ipc.messages import decode_or_none, encode
from shardserve.ipc.messages.api import AbortReq
from shardserve.ipc.secure import SecretError, connect_secure, deployment_secret
from shardserve.ipc.sockets import Endpoints, connected, recv_all
from shardserve.ipc.sockets import bound as _bound


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def wait_for(cond, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what or cond}"
        time.sleep(0.02)


def test_only_the_deployment_secret_gets_a_message_through(caplog):
    """No forged frame gets through, shown by events rather than by waiting: each forger's own
    socket reports its handshake failed (a PUSH socket sends nothing before its handshake
    succeeds, and none of theirs ever does), and a genuine frame sent only after all of them were
    refused, on the same channel, is the only message there."""
    from shardserve.ipc.secure import Gate, _keys

    ctx = zmq.Context()
    addr = f"tcp://127.0.0.1:{free_port()}"
    gate = Gate(ctx, b"the-right-secret-0123456789")
    inbox = _bound(ctx, zmq.PULL, addr, b"the-right-secret-0123456789", gate, "the test channel")
    forgers: dict[str, zmq.Socket] = {}
    monitors: dict[str, zmq.Socket] = {}
    right = None
    try:
        forgers["plain"] = ctx.socket(zmq.PUSH)  # no CURVE at all
        forgers["wrong"] = ctx.socket(zmq.PUSH)
        connect_secure(forgers["wrong"], b"another-secret-0123456789")
        # Knows the server's public key (say it leaked) but holds its own key pair: the Gate refuses it.
        leaked = forgers["leaked"] = ctx.socket(zmq.PUSH)
        leaked.curve_serverkey = _keys(b"the-right-secret-0123456789")[0]
        leaked.curve_publickey, leaked.curve_secretkey = zmq.curve_keypair()
        for name, sock in forgers.items():
            sock.setsockopt(zmq.LINGER, 0)
            monitors[name] = sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            sock.connect(addr)
            sock.send(encode(AbortReq(rid=f"forged by {name}")), zmq.NOBLOCK)  # queued until a handshake succeeds
        events: dict[str, list[int]] = {name: [] for name in forgers}

        def all_refused() -> bool:
            for name, mon in monitors.items():
                while mon.poll(0):
                    events[name].append(recv_monitor_message(mon)["event"])
            return all(any(e & HANDSHAKE_FAILED for e in ev) for ev in events.values())

        wait_for(all_refused, what="every forger's handshake to fail")
        right = connected(ctx, zmq.PUSH, addr, b"the-right-secret-0123456789")
        right.setsockopt(zmq.LINGER, 0)
        right.send(encode(AbortReq(rid="genuine")), zmq.NOBLOCK)
        got = []

        def arrived() -> bool:
            if inbox.poll(50):
                got.extend(recv_all(inbox, "test"))
            return bool(got)

        wait_for(arrived, what="the genuine frame")
        got += recv_all(inbox, "test")  # a forged frame let in would have been queued before the genuine one
        assert got == [AbortReq(rid="genuine")]
        all_refused()
        assert not any(zmq.EVENT_HANDSHAKE_SUCCEEDED in ev for ev in events.values()), events
        assert len(gate.refused) == 1  # the leaked-server-key peer, refused by the Gate (and logged once)
        # The plain socket and the wrong secret, at the handshake (the Gate's monitor thread counts them).
        wait_for(lambda: gate.failed_handshakes >= 2, what="the Gate to count the failed handshakes")
        wait_for(lambda: "refused a peer on the test channel" in caplog.text, what="the refusal's log line")
        assert caplog.text.count("refused a peer on the test channel") == 1
    finally:
        for sock in (*monitors.values(), *forgers.values(), *([right] if right is not None else [])):
            sock.close(0)
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


def test_a_taken_port_is_one_line_naming_the_channel():
    """A channel's port held by another process (torchrun's MASTER_PORT + 2, say): a one-line
    refusal the launcher shows as is, not a ZeroMQ traceback."""
    ctx = zmq.Context()
    port = free_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    try:
        taken = rf"^the plan feed cannot listen on tcp://127.0.0.1:{port}: Address already"
        with pytest.raises(ValueError, match=taken):
            _bound(ctx, zmq.PUB, f"tcp://127.0.0.1:{port}", b"s" * 32, None, "the plan feed")
    finally:
        holder.close()
        ctx.term()
