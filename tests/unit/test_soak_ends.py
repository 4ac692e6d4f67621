"""`shardserve bench soak` ends with a report, not a traceback, when the server goes away, and
spawns its server with a restart limit its own kills cannot reach."""

from __future__ import annotations

import argparse
import socket

from shardserve.bench.soak import Soak, clean_error, report, spawn_args
from shardserve.cli.bench_flags import add_soak_args


def soak_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_soak_args(p)
    return p.parse_args(list(argv))


def closed_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


def test_killer_reports_a_server_that_stopped_answering(capsys):
    args = soak_args("--url", "x", "--kill-every", "0.01")
    soak = Soak(closed_url(), args, server=None)
    soak.killer(seed=0)  # returns instead of raising ConnectError
    assert soak.stop.is_set() and soak.ended.startswith("the server stopped answering /health: ConnectError")
    assert report(soak.tally, soak.kills, soak.ended, {}, {}, {}, args) == 1
    assert "soak: FAILED: the server stopped answering /health" in capsys.readouterr().out


def test_spawned_server_gets_a_restart_limit_above_the_planned_kills():
    spawn = spawn_args(soak_args("--spawn", "--dp-size 2", "--duration", "1800", "--kill-every", "120"))
    assert spawn[:4] == ["--dp-size", "2", "--num-pages", "256"] and spawn[4] == "--replica-restart-limit"
    assert int(spawn[5]) > 1800 / 60  # kills come at least 0.5 x --kill-every apart
    given = spawn_args(soak_args("--spawn", "--dp-size 2 --replica-restart-limit 1 --num-pages 64",
                                 "--kill-every", "5"))
    assert given == ["--dp-size", "2", "--replica-restart-limit", "1", "--num-pages", "64"]
    assert spawn_args(soak_args("--spawn", "--kv-cache-memory 0.1", "--kill-every", "0")) == ["--kv-cache-memory",
                                                                                               "0.1"]


def test_only_a_server_that_could_not_serve_now_is_a_clean_error():
    body = {"error": {"message": "replica 1 stopped while this request was running: killed", "code": "503"}}
    assert clean_error(503, body) == ("error", body["error"]["message"])
    assert clean_error(504, {"error": {"message": "ran longer than --request-timeout"}})[0] == "error"
    assert clean_error(500, {"error": {"message": "internal error: boom"}}) == ("lost", "500: internal error: boom")
    assert clean_error(503, {}) == ("lost", "503: no error body")
