"""Private TCP channels between our own processes: ZeroMQ CURVE keyed by one deployment secret.

Channels between processes on one machine are ipc sockets in a directory only the server's user
can enter (mode 0700, `Endpoints.create`). Channels that cross machines (the node channel, the plan
feed to remote ranks, the results inbox) are TCP, and anything that reaches the port could write
to them: a forged plan would be run by every rank. So every TCP channel is a CURVE channel whose
one key pair is derived from the deployment secret: the binding side is the CURVE server, and a
ZAP handler (`Gate`) admits only peers presenting the deployment's public key. A peer without the
secret fails the handshake inside ZeroMQ, before a single byte of its reaches our decoder; it is
logged once per channel (a socket monitor sees the failed handshake; the ZAP handler the rest).
CURVE also encrypts, so prompts in plans cannot be read on the wire.

Where the secret comes from (`deployment_secret`): SHARDSERVE_DIST_SECRET, or a file
(`--dist-secret-file`; node 0 writes a fresh one, mode 0600, if it does not exist yet). It never
appears in argv, logs or reprs; children get it through the pickled launch arguments on stdin.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import threading

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("shardserve.secure")
SECRET_ENV = "SHARDSERVE_DIST_SECRET"
MAX_MESSAGE = 1 << 30  # bytes; a larger frame on a TCP channel drops the connection (zmq MAXMSGSIZE)


class SecretError(ValueError):
    """No usable deployment secret; the message says how to give one."""


def deployment_secret(path: str | None, create: bool) -> bytes:
    """The secret from the environment, else from the file at `path` (created with a fresh random
    secret when `create`, i.e. on node 0), else b"" (the caller decides if that is enough)."""
    env = os.environ.get(SECRET_ENV, "")
    if env:
        return env.encode()
    if not path:
        return b""
    if not os.path.exists(path):
        if not create:
            raise SecretError(f"--dist-secret-file {path} does not exist: copy node 0's file here")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        log.info("wrote a new deployment secret to %s: give every other node the same file", path)
    with open(path, encoding="utf-8") as f:
        value = f.read().strip()
    if len(value) < 16:
        raise SecretError(f"--dist-secret-file {path} holds fewer than 16 characters")
    return value.encode()


def new_secret() -> bytes:
    return secrets.token_hex(32).encode()


def _keys(secret: bytes) -> tuple[bytes, bytes]:
    """(public, secret) z85 CURVE keys, the same on every process that holds `secret`."""
    private = zmq.utils.z85.encode(hashlib.sha256(b"shardserve-curve\x00" + secret).digest())
    return zmq.curve_public(private), private


def serve_secure(sock: zmq.Socket, secret: bytes) -> None:
    """Make a socket that binds a TCP address a CURVE server (call before bind)."""
    _curve(sock, secret, server=True)


def connect_secure(sock: zmq.Socket, secret: bytes) -> None:
    """Make a socket that connects to a CURVE server of this deployment (call before connect)."""
    _curve(sock, secret, server=False)


def _curve(sock: zmq.Socket, secret: bytes, server: bool) -> None:
    # Every process holds the one key pair: a server proves it by its key, a client by its own.
    public, private = _keys(secret)
    if server:
        sock.curve_server = True
    else:
        sock.curve_serverkey = public
    sock.curve_publickey = public
    sock.curve_secretkey = private
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)


class Gate:
    """The ZAP handler of one process's context: admits the deployment's key only. `watch` also
    logs (once per channel) peers that fail a socket's CURVE handshake before ZAP is asked: those
    without the secret, or with another one."""

    HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                        | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    def __init__(self, ctx: zmq.Context, secret: bytes):
        self.public, _ = _keys(secret)
        self.refused: set[bytes] = set()
        self.failed_handshakes = 0
        self._done = threading.Event()
        self._threads: list[threading.Thread] = []
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("shardserve.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP asks: may a client with CURVE public `key` in? (The peer's address is not given.)"""
        ok = zmq.utils.z85.encode(key) == self.public if len(key) == 32 else key == self.public
        if not ok and key not in self.refused:
            self.refused.add(key)
            log.warning("refused a connection from a peer without this deployment's secret")
        return ok

    def watch(self, sock: zmq.Socket, channel: str) -> None:
        monitor = sock.get_monitor_socket(self.HANDSHAKE_FAILED)
        thread = threading.Thread(target=self._watch, args=(monitor, channel), name=f"gate {channel}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _watch(self, monitor: zmq.Socket, channel: str) -> None:
        logged = False
        try:
            while not self._done.is_set():
                if monitor.poll(200):
                    recv_monitor_message(monitor)
                    self.failed_handshakes += 1
                    if not logged:
                        logged = True
                        log.warning("refused a peer on %s: it failed the secure handshake (no deployment secret, "
                                    "or another one); further refusals there are not logged", channel)
        except zmq.ZMQError:
            pass  # the socket closed under us: nothing left to watch
        finally:
            monitor.close(linger=0)

    def stop(self) -> None:
        self._done.set()
        for thread in self._threads:
            thread.join(1.0)
        self.auth.stop()
