"""Replicas that survive (--dp-size): a replica's rank is SIGKILLed under a steady openai-client
load; requests that had streamed nothing are answered by another replica, a stream that was
running on the dead replica ends with an error naming it, the others go on, and the replica is
started again and serves; a replica past --replica-restart-limit stays down, and the server ends
only once every replica is down for good."""

from __future__ import annotations

import os
import re
import signal
import statistics
import sys
import threading
import time

import httpx
import openai
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from server_util import LongStream, Server  # noqa: E402

pytestmark = pytest.mark.slow
FLAGS = ("--num-pages", "128", "--page-size", "8")


class Load:
    """Clients sending short non-streaming completions back to back, each result kept."""

    def __init__(self, url: str, clients: int = 3, max_tokens: int = 16):
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        self.results: list[tuple[float, float, str | None, str, tuple]] = []  # start, end, error, text, prompt
        self.max_tokens = max_tokens
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            start, prompt = time.monotonic(), [7 + i, 8, 9 + n % 5]
            try:
                r = self.client.completions.create(model=None, prompt=prompt, max_tokens=self.max_tokens,
                                                   temperature=0)
                self.results.append((start, time.monotonic(), None, r.choices[0].text, tuple(prompt)))
            except openai.APIError as e:
                self.results.append((start, time.monotonic(), repr(e), "", tuple(prompt)))

    def stop(self) -> list[tuple[float, float, str | None, str, tuple]]:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        return list(self.results)


def health(url: str) -> tuple[int, dict]:
    r = httpx.get(url + "/health", timeout=5)
    return r.status_code, r.json()


def metric(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf'^{name}\{{replica="(\d+)"\}} (\S+)', text, re.M)}


def wait_settled(url: str, replicas: int, timeout: float = 30) -> dict[str, float]:
    """Per-replica KV pages in use once no request runs anywhere."""
    deadline = time.monotonic() + timeout
    while True:
        running = metric(url, "shardserve_replica_num_requests_running")
        if len(running) == replicas and not any(running.values()):
            return metric(url, "shardserve_replica_kv_pages_used")
        assert time.monotonic() < deadline, running
        time.sleep(0.2)


def test_dp3_replica_killed_under_load_restarts_and_loses_nothing(tiny_model, tmp_path):
    path, _ = tiny_model("llama")
    server = Server("--model", path, "--dp-size", "3", *FLAGS, log_path=str(tmp_path / "log"))
    try:
        url = server.url
        baseline_pages = wait_settled(url, 3)
        load = Load(url)  # the load alone, for its latency
        time.sleep(4)
        alone = load.stop()
        base = statistics.median(e - s for s, e, err, _, _ in alone if err is None)

        load = Load(url)
        streams = [LongStream(url, max_tokens=400, prompt=[50 + i, 6]) for i in range(3)]
        for s in streams:
            s.wait_running()
        os.kill(server.last_pid("scheduler-1"), signal.SIGKILL)
        killed = time.monotonic()
        failed = [s.ended_in_error(60) for s in streams]
        body = server.wait_replica(1, "serving", restarts=1)
        back = time.monotonic()
        routed_back = metric(url, "shardserve_replica_routed_requests")["1"]
        time.sleep(3)  # the restarted replica takes its share of the load
        results = load.stop()
        routed_end = metric(url, "shardserve_replica_routed_requests")["1"]
        pages_end = wait_settled(url, 3)
        restarts = metric(url, "shardserve_replica_restarts")
        placed_again = metric(url, "shardserve_replica_requests_placed_again")
    finally:
        code, left = server.stop()
    log = server.read_log()
    assert code == 0 and left == [], log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert "replica 1: scheduler-1 (dp 1) was killed by signal 9; starting it again in 0 s" in log
    # The stream on replica 1 ended in an error naming it; the other replicas' streams finished.
    assert failed.count(True) == 1, failed
    bad = next(s for s, f in zip(streams, failed) if f)
    assert any("replica 1 stopped while this request was running" in e for e in bad.events), bad.events[-3:]
    # No non-streaming request failed, and each prompt got one answer wherever it ran.
    assert [err for _, _, err, _, _ in results if err is not None] == []
    texts: dict[tuple, set[str]] = {}
    for _, _, _, text, prompt in alone + results:
        texts.setdefault(prompt, set()).add(text)
    assert all(len(t) == 1 for t in texts.values()), texts
    assert body["status"] == "ok" and [r["state"] for r in body["replicas"]] == ["serving"] * 3
    assert restarts == {"0": 0.0, "1": 1.0, "2": 0.0}
    assert routed_end > routed_back  # it serves again
    assert pages_end == baseline_pages
    during = [e - s for s, e, _, _, _ in results if killed <= s and e <= back]
    assert len(during) >= 5, f"only {len(during)} requests ran while replica 1 restarted"  # the load went on
    print(f"load latency median {base:.3f} s alone, {statistics.median(during):.3f} s over {len(during)} "
          f"requests while replica 1 restarted ({back - killed:.1f} s); {placed_again['1']:.0f} placed again")
    assert statistics.median(during) < 2 * base, (base, during)


def test_restart_limit_then_every_replica_down_ends_the_server(tiny_model, tmp_path):
    path, _ = tiny_model("llama")
    server = Server("--model", path, "--dp-size", "2", "--replica-restart-limit", "1", *FLAGS,
                    log_path=str(tmp_path / "log"))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    try:
        os.kill(server.last_pid("scheduler-1"), signal.SIGKILL)
        server.wait_replica(1, "serving", restarts=1)
        os.kill(server.last_pid("scheduler-1"), signal.SIGKILL)  # a second time in a row: past the limit
        body = server.wait_replica(1, "down")
        assert health(server.url)[0] == 200 and body["status"] == "degraded"
        assert "killed by signal 9" in body["replicas"][1]["reason"]
        assert metric(server.url, "shardserve_replica_up") == {"0": 1.0, "1": 0.0}
        # Replica 0 serves every request meanwhile.
        for n in range(4):
            r = client.completions.create(model=None, prompt=[3, n], max_tokens=4, temperature=0)
            assert len(r.choices[0].text) > 0 or r.usage.completion_tokens == 4
        os.kill(server.last_pid("scheduler-0"), signal.SIGKILL)  # replica 0 restarts: its limit is its own
        server.wait_replica(0, "serving", restarts=1)
        os.kill(server.last_pid("scheduler-0"), signal.SIGKILL)
        server.proc.wait(60)
    finally:
        code, left = server.stop()
    log = server.read_log()
    assert code != 0 and left == [], log[-3000:]
    assert "replica 1: scheduler-1 (dp 1) was killed by signal 9; it stays down" in log
    assert "every replica is down and will not be started again (--replica-restart-limit 1)" in log


def test_dp2_tp2_non_leader_rank_killed_restarts_its_replica(tiny_model, tmp_path):
    path, _ = tiny_model("llama")
    server = Server("--model", path, "--dp-size", "2", "--tp-size", "2", *FLAGS, log_path=str(tmp_path / "log"))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    try:
        want = [client.completions.create(model=None, prompt=[3, n], max_tokens=8, temperature=0).choices[0].text
                for n in range(4)]
        leader = server.last_pid("scheduler-2")
        load = Load(server.url, clients=2)
        time.sleep(1)
        os.kill(server.last_pid("scheduler-3"), signal.SIGKILL)  # replica 1's tp 1
        server.wait_replica(1, "serving", restarts=1)
        results = load.stop()
        assert server.last_pid("scheduler-2") != leader  # the whole replica was started afresh
        assert [err for _, _, err, _, _ in results if err is not None] == []
        got = [client.completions.create(model=None, prompt=[3, n], max_tokens=8, temperature=0).choices[0].text
               for n in range(4)]
        assert got == want
    finally:
        code, left = server.stop()
    log = server.read_log()
    assert code == 0 and left == [], log[-3000:]
    assert "replica 1: scheduler-3 (dp 1, tp 1) was killed by signal 9" in log
