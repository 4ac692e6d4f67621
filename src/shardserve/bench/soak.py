"""`shardserve bench soak`: a bounded run of mixed traffic against a server whose replicas are
killed at random, then a check that nothing was lost.

Clients send, at random: completions and chat, whole and streamed; a JSON-schema structured
output; a stream the client drops after its first chunk; a malformed body. Every request is
greedy over a small pool of prompts, so each (endpoint, prompt) has one right answer, taken
during warm-up before anything is killed. With `--kill-every S` a rank of a random serving
replica is SIGKILLed about every S seconds (the spawned server's log names the pids).

At the end every request must have had exactly one outcome: a complete answer equal to its
reference (a dropped or doubled piece of text reads as a mismatch), an error the server
answered (an HTTP error or a stream's error event), the client's own disconnect, or a 400 for a
malformed body. Lost requests (no answer, a stream that stopped without [DONE] or an error, a
5xx for a bad body) fail the run, as do KV pages, running requests or router load left over
once idle, and resident memory grown by more than `--max-rss-growth` after warm-up.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import threading
import time

import httpx

from shardserve.bench.soak_report import KINDS, Tally, memory_by_process, report, started
from shardserve.bench.spawn import Spawned

WEIGHTS = (20, 20, 15, 15, 10, 10, 10)
PROMPTS = ("The capital of France is", "Write one line about the sea.", "Count to five:", "Name a colour.",
           "What is 2 + 2?", "Say hello in Spanish.")
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}}, "required": ["answer"]}
SOAK_PAGES = 256
BAD_BODIES = ('{"prompt": "x", "max_tokens": -1}', '{"prompt": "x", "temperature": "hot"}', "{not json",
              '{"prompt": "x", "no_such_field": 1}', '{"messages": "not a list"}')


def body_of(kind: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    """(path, JSON body) of a greedy request of `kind`."""
    chat = kind.startswith("chat") or kind == "structured"
    body: dict = {"max_tokens": max_tokens, "temperature": 0, "stream": kind.endswith("stream") or kind == "disconnect"}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if kind == "structured":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def text_of(choice: dict) -> str:
    if "text" in choice:
        return choice["text"]
    part = choice.get("message") or choice.get("delta") or {}
    return part.get("content") or ""


def answer(http: httpx.Client, kind: str, prompt: str, max_tokens: int) -> tuple[str, str]:
    """One request: ("ok", its text), ("error", why), ("disconnected", ""), or ("lost", why)."""
    path, body = body_of(kind, prompt, max_tokens)
    if not body["stream"]:
        r = http.post(path, json=body)
        if r.status_code != 200:
            return clean_error(r.status_code, r.json())
        choice = r.json()["choices"][0]
        return ("ok", text_of(choice)) if choice.get("finish_reason") else ("lost", "no finish_reason")
    text, finished = "", False
    with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            r.read()
            return clean_error(r.status_code, r.json())
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if kind == "disconnect":
                return "disconnected", ""  # leaving the block closes the connection mid-stream
            if line == "data: [DONE]":
                return ("ok", text) if finished else ("lost", "[DONE] without a finish_reason")
            event = json.loads(line[6:])
            if "error" in event:
                code = str(event["error"].get("code") or "")
                return clean_error(int(code) if code.isdigit() else 0, event)
            for choice in event.get("choices", []):
                text += text_of(choice)
                finished = finished or choice.get("finish_reason") is not None
    return "lost", "the stream ended without [DONE] or an error"


def clean_error(status: int, body: dict) -> tuple[str, str]:
    """A well-formed request's error: "error" where the server said it could not serve it now
    (503: its replica stopped mid-stream, 504: a timeout), else "lost" (a 500 is a bug)."""
    message = str(body.get("error", {}).get("message", ""))[:200] if isinstance(body.get("error"), dict) else ""
    if status in (503, 504) and message:
        return "error", message
    return "lost", f"{status}: {message or 'no error body'}"


def bad_body(http: httpx.Client, rng: random.Random) -> tuple[str, str]:
    path = rng.choice(("/v1/completions", "/v1/chat/completions"))
    r = http.post(path, content=rng.choice(BAD_BODIES), headers={"content-type": "application/json"})
    if r.status_code == 400 and "error" in r.json():
        return "refused", ""
    return "lost", f"a malformed body got {r.status_code}"


class Soak:
    def __init__(self, url: str, args, server: Spawned | None):
        self.url, self.args, self.server = url, args, server
        self.tally = Tally()
        self.reference: dict[tuple[str, str], str] = {}
        self.stop = threading.Event()
        self.kills: list[str] = []
        self.ended = ""  # why the run ended early, if it did

    def warm_up(self) -> None:
        """The reference answers (nothing killed yet), each asked twice: a server giving two
        answers to one greedy request is already a failure."""
        with httpx.Client(base_url=self.url, timeout=self.args.request_timeout) as http:
            for kind in ("completion", "chat", "structured"):
                for p in PROMPTS:
                    got = {answer(http, kind, p, self.args.max_tokens) for _ in range(2)}
                    if len(got) != 1 or next(iter(got))[0] != "ok":
                        raise RuntimeError(f"warm-up: {kind} {p!r} gave {got}")
                    self.reference[kind, p] = next(iter(got))[1]

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=self.args.request_timeout) as http:
            while not self.stop.is_set():
                kind = rng.choices(KINDS, WEIGHTS)[0]
                prompt = rng.choice(PROMPTS)
                try:
                    if kind == "bad-body":
                        outcome, detail = bad_body(http, rng)
                    else:
                        outcome, detail = answer(http, kind, prompt, self.args.max_tokens)
                except (httpx.HTTPError, ValueError) as e:  # ValueError: a body that is not JSON
                    outcome, detail = "lost", f"{type(e).__name__}: {e}"
                if outcome == "ok":
                    ref = self.reference[kind.removesuffix("-stream"), prompt]
                    if detail != ref:
                        outcome, detail = "mismatch", f"{prompt!r}: {detail!r} != {ref!r}"
                self.tally.add(kind, outcome, detail if outcome in ("lost", "mismatch") else "")

    def fail(self, why: str) -> None:
        """End the run early: the server itself stopped (counted as a failure in the report)."""
        if not self.ended:
            self.ended = why
            print(f"[soak] {why}", file=sys.stderr, flush=True)
        self.stop.set()

    def killer(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.wait(rng.uniform(0.5, 1.5) * self.args.kill_every):
            try:
                body = httpx.get(self.url + "/health", timeout=10).json()
            except (httpx.HTTPError, ValueError) as e:
                self.fail(f"the server stopped answering /health: {type(e).__name__}: {e}")
                return
            serving = [r["replica"] for r in body.get("replicas", []) if r["state"] == "serving"]
            if not serving:
                continue
            replica = rng.choice(serving)
            pids = rank_pids(self.server.tail(10**9))
            ranks = len(pids) // len(body["replicas"])
            rank = replica * ranks + rng.randrange(ranks)
            pid = pids[rank]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it died since /health answered: try again next round
                continue
            self.kills.append(f"scheduler-{rank} (replica {replica}) at {time.strftime('%H:%M:%S')}")
            print(f"[soak] killed scheduler-{rank} (replica {replica}, pid {pid})", file=sys.stderr, flush=True)


def rank_pids(log: str) -> list[int]:
    """Each scheduler rank's latest pid, by rank, from the server's log."""
    pids = {int(name.removeprefix("scheduler-")): pid for pid, name in started(log).items()
            if name.startswith("scheduler-")}  # in the order started: a rank's latest pid wins
    return [pids[r] for r in sorted(pids)]


def settled(url: str, timeout: float) -> dict[str, float]:
    """Once every replica serves and nothing runs: the leftovers that must be zero."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _leftovers(url, deadline)
        except httpx.HTTPError as e:
            if time.monotonic() > deadline:
                return {f"/metrics or /health unreachable ({type(e).__name__})": 1.0}
            time.sleep(1.0)


def _leftovers(url: str, deadline: float) -> dict[str, float]:
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        values: dict[str, float] = {}
        for name in ("shardserve_replica_num_requests_running", "shardserve_replica_num_requests_waiting",
                     "shardserve_replica_kv_pages_used", "shardserve_replica_load_tokens",
                     "shardserve_num_requests_running", "shardserve_num_requests_waiting", "shardserve_kv_pages_used"):
            for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M):
                values[name + (m.group(1) or "")] = float(m.group(2))
        health = httpx.get(url + "/health", timeout=10)
        if (health.status_code == 200 and health.json().get("status") == "ok" and not any(values.values())) \
                or time.monotonic() > deadline:
            return {k: v for k, v in values.items() if v}
        time.sleep(0.5)


def spawn_args(args) -> list[str]:
    """The server's flags. Unless they name a restart limit, one the planned kills cannot reach:
    kills every --kill-every seconds come faster than a replica's restart count resets, and a
    replica that gave up would end the soak rather than test it."""
    spawn = args.spawn.split()
    if not {"--num-pages", "--kv-cache-memory"} & set(spawn):
        # The KV pool is allocated untouched and pages become resident as the allocator first
        # hands them out (a restarted rank starts over): a small pool is wholly touched during
        # warm-up, so that what grows afterwards is a leak, not the pool.
        spawn += ["--num-pages", str(SOAK_PAGES)]
        print(f"[soak] serving with --num-pages {SOAK_PAGES} (a KV pool warm-up touches whole)",
              file=sys.stderr, flush=True)
    if args.kill_every and "--replica-restart-limit" not in spawn:
        limit = int(args.duration / (0.5 * args.kill_every)) + 2
        spawn += ["--replica-restart-limit", str(limit)]
        print(f"[soak] serving with --replica-restart-limit {limit} (more than the kills planned)",
              file=sys.stderr, flush=True)
    return spawn


def watch(soak: Soak, server: Spawned | None, end: float) -> None:
    """Until `end`: progress every 30 s, and the run ended early should the server exit."""
    while not soak.stop.wait(min(30.0, max(0.0, end - time.monotonic()))):
        if server is not None and server.proc.poll() is not None:
            soak.fail(f"the server exited with {server.proc.returncode}:\n{server.tail(2000)}")
        if time.monotonic() >= end:
            break
        done = sum(soak.tally.outcomes.values())
        print(f"[soak] {done} requests, {len(soak.kills)} kills so far", file=sys.stderr, flush=True)


def run_soak(args) -> int:
    server = None
    if args.spawn is not None:
        server = Spawned("serve", spawn_args(args), "server", timeout=args.startup_timeout)
    url = server.url if server else args.url.rstrip("/")
    try:
        soak = Soak(url, args, server)
        soak.warm_up()
        threads = [threading.Thread(target=soak.client, args=(args.seed * 1000 + i,), daemon=True)
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(min(args.warmup, args.duration / 2))  # memory settles under the load first
        rss_start = memory_by_process(server)
        killer = None
        if args.kill_every and server is not None:
            killer = threading.Thread(target=soak.killer, args=(args.seed,), daemon=True)
            killer.start()
        watch(soak, server, time.monotonic() + args.duration - min(args.warmup, args.duration / 2))
        soak.stop.set()
        for t in threads + ([killer] if killer else []):
            t.join(args.request_timeout + 10)
        left = {} if soak.ended else settled(url, args.settle_timeout)
        rss_end = memory_by_process(server)
    finally:
        if server is not None:
            server.stop()
    return report(soak.tally, soak.kills, soak.ended, left, rss_start, rss_end, args)
