"""The life of every child process: set up, report Ready (or Failed), serve, exit cleanly."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable

import zmq

from shardserve.ipc.messages.lifecycle import Failed, Ready
from shardserve.ipc.sockets import die_with_parent, push, send
from shardserve.logs import LOG_LEVEL_ENV


def setup_logging(name: str) -> None:
    level = os.environ.get(LOG_LEVEL_ENV, "info").upper()  # the launcher's --log-level
    logging.basicConfig(level=level, force=True,
                        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s")


def run_child(name: str, ready_addr: str, setup: Callable[[], tuple[Callable[[], None], dict]],
              secret: bytes = b"") -> None:
    """`setup()` builds the process's state and returns (serve loop, info for the Ready message);
    `secret` keys a TCP ready channel (ranks placed by Ray report to the launcher over one).

    Any exception during setup is reported to the launcher with its traceback, so the launcher
    can print it and exit instead of waiting."""
    die_with_parent()
    setup_logging(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher owns Ctrl-C and stops us with SIGTERM
    # Until Ready a SIGTERM (the launcher giving the start up) ends the process at once: as a
    # SystemExit it could land in an import's weakref callback, which prints it as an ignored
    # exception and carries on; nothing set up yet needs an orderly exit.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    # Its own context: term() then waits for just this socket's message to leave, which a bare
    # close() before os._exit would not.
    ctx = zmq.Context()
    ready = push(ctx, ready_addr, secret)
    try:
        loop, info = setup()
    except BaseException:
        send(ready, Failed(name=name, error=traceback.format_exc()))
        ready.close(linger=2000)
        ctx.term()
        os._exit(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    send(ready, Ready(name=name, info=info))
    ready.close(linger=2000)
    ctx.term()
    code = 0
    try:
        loop()
    except SystemExit as e:  # SIGTERM (0), or a loop that said why it stops and chose its code
        code = e.code if isinstance(e.code, int) else 0
    except BaseException:
        logging.getLogger(name).exception("%s crashed", name)
        os._exit(1)
    fast_exit(code)


def fast_exit(code: int) -> None:
    """Exit after the exit handlers (they unregister semaphores, flush logs) but without the
    interpreter's module teardown, which for torch and transformers costs seconds of CPU."""
    # A SIGTERM from here on just ends the process: raising SystemExit inside an exit handler
    # would print a traceback for an exit that was already under way.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

