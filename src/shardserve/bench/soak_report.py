"""`shardserve bench soak`'s findings: what each kind of request came to, and the server's
resident memory by process."""

from __future__ import annotations

import re
import threading
from collections import Counter
from dataclasses import dataclass, field

from shardserve.bench.spawn import Spawned, tree_rss_kb

KINDS = ("completion", "completion-stream", "chat", "chat-stream", "structured", "disconnect", "bad-body")
OUTCOMES = ("ok", "error", "disconnected", "refused", "lost", "mismatch")


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # (kind, outcome)
    problems: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, outcome: str, problem: str = "") -> None:
        with self.lock:
            self.outcomes[kind, outcome] += 1
            if problem and len(self.problems) < 50:
                self.problems.append(f"{kind}: {problem}")


def started(log: str) -> dict[int, str]:
    """pid -> the name of the process the server's log says it started there, in start order."""
    return {int(p): n for n, p in re.findall(r"started (\S+) pid=(\d+)", log)}


def memory_by_process(server: Spawned | None) -> dict[str, tuple[int, int, int]]:
    """(VmRSS, RssAnon in KiB, processes) of each of the server's processes, by the name its log
    gives the pid ("api" for the server itself; a rank started again keeps its name)."""
    if server is None:
        return {}
    names = started(server.tail(10**9))
    names[server.proc.pid] = "api"
    out: dict[str, tuple[int, int, int]] = {}
    for pid, (rss, anon) in tree_rss_kb(server.proc.pid).items():
        name = names.get(pid, "other")
        old = out.get(name, (0, 0, 0))
        out[name] = (old[0] + rss, old[1] + anon, old[2] + 1)
    return out



def report(tally: Tally, kills: list[str], ended: str, left: dict[str, float], rss_start: dict, rss_end: dict,
           args) -> int:
    """Print the findings; 1 if the run failed (`ended`: why it ended early, if it did)."""
    out = tally.outcomes
    print(f"{'kind':<18} " + " ".join(f"{o:>12}" for o in OUTCOMES))
    for kind in KINDS:
        print(f"{kind:<18} " + " ".join(f"{out[kind, o]:>12}" for o in OUTCOMES))
    total = sum(out.values())
    bad = sum(n for (_, o), n in out.items() if o in ("lost", "mismatch"))
    print(f"requests {total}, lost or wrong {bad}; replica kills {len(kills)}")
    start, end = (sum(v[0] for v in m.values()) for m in (rss_start, rss_end))
    growth = (end / start - 1) if start else 0.0
    if start:
        print(f"resident memory of the server's processes: {start / 1024:.0f} MiB after warm-up, "
              f"{end / 1024:.0f} MiB at the end ({growth:+.1%}); by process, MiB (anonymous):")
        for name in sorted(set(rss_start) | set(rss_end)):
            (a, a_anon, _), (b, b_anon, n) = rss_start.get(name, (0, 0, 0)), rss_end.get(name, (0, 0, 0))
            many = f"  ({n} processes at the end)" if n > 1 else ""
            print(f"  {name:<16} {a / 1024:8.0f} ({a_anon / 1024:.0f}) -> {b / 1024:8.0f} ({b_anon / 1024:.0f}){many}")
    failures = [ended.splitlines()[0]] if ended else []
    failures += [f"{bad} requests lost or wrong"] if bad else []
    failures += [f"left over once idle: {left}"] if left else []
    failures += [f"resident memory grew {growth:.1%} (> {args.max_rss_growth:.0%})"] if growth > args.max_rss_growth \
        else []
    for p in tally.problems[:10]:
        print(f"  {p}")
    print("soak: " + ("PASSED" if not failures else "FAILED: " + "; ".join(failures)))
    return 1 if failures else 0
