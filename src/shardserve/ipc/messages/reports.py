"""What the engine reports, for /metrics and the in-server router: the leaders' Stats (merged
over replicas), every rank's collective counts on request, a replica's cache news for the router
(dp > 1), and the router's own counts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

from shardserve.ipc.messages.base import Msg


class ReportReq(Msg):
    """Ask every rank for its collective counts; rank 0 answers with RankReports."""

    rid: str


class RankReports(Msg):
    rid: str
    reports: list[dict]  # by global rank: {"rank": r, "groups": {kind: {op: {"calls", "MB"}}}}


class Stats(Msg):
    running: int
    waiting: int
    pages_used: int
    pages_total: int
    prefix_hit_rate: float
    prefix_hit_tokens: int = 0  # prompt tokens served from the cache so far
    prefix_query_tokens: int = 0  # prompt tokens looked up so far
    steps: int = 0
    finished: int = 0  # requests finished (or aborted) so far
    traffic: dict = {}  # rank 0's tensor-parallel group counts, by operation
    control: dict = {}  # rank 0's control group counts (step plans, results)
    max_in_flight: int = 0  # the most micro-batches in flight at once so far
    preemptions: int = 0
    stages: dict = {}  # pipeline stage -> that stage's tensor rank 0's counts by group (StageTraffic.groups)
    replica: int = 0  # which data-parallel replica's leader sent it
    empty_steps: int = 0  # data-parallel attention: steps run with no tokens, to join the other replicas
    # MoE routing counts of the leader's layers (the first pipeline stage's): layer -> pairs per expert
    expert_routed: dict[str, list[int]] = {}
    # Disaggregation: KV shipped (prefill side) or received (decode side), see kvcache/transfer.py
    transfer: dict = {}
    # Speculative decoding's counters (scheduler/speculator.py SpecCounts.as_dict); {}: off
    speculative: dict = {}
    # LoRA adapters (scheduler/engine_stats.lora_stats); {}: off
    lora: dict = {}


_SUMMED = ("running", "waiting", "pages_used", "pages_total", "steps", "finished", "preemptions",
           "prefix_hit_tokens", "prefix_query_tokens", "empty_steps")


def merge_stats(reps: list[Stats]) -> Stats:
    """Several replicas' stats as one: counts (routing counts too) summed, the hit rate over all
    their prompt tokens; traffic and pipeline stages are replica 0's (rank 0's, as with one
    replica)."""
    if len(reps) == 1:
        return reps[0]
    queries = sum(s.prefix_query_tokens for s in reps)
    first = min(reps, key=lambda s: s.replica)
    return Stats(**{f: sum(getattr(s, f) for s in reps) for f in _SUMMED},
                 prefix_hit_rate=sum(s.prefix_hit_tokens for s in reps) / queries if queries else 0.0,
                 max_in_flight=max(s.max_in_flight for s in reps), traffic=first.traffic, control=first.control,
                 stages=first.stages, expert_routed=sum_counts([s.expert_routed for s in reps]),
                 speculative=merge_speculative([s.speculative for s in reps]),
                 lora=merge_lora([s.lora for s in reps]))


def merge_lora(parts: list[dict]) -> dict:
    """Replicas' LoRA numbers added up (requests per adapter name too)."""
    parts = [p for p in parts if p]
    if not parts:
        return {}
    out = {k: sum(p[k] for p in parts) for k in ("slots", "slots_used", "loads")}
    for k in ("running", "waiting"):
        out[k] = {}
        for p in parts:
            for name, n in p[k].items():
                out[k][name] = out[k].get(name, 0) + n
    return out


def merge_speculative(parts: list[dict]) -> dict:
    """Replicas' speculative-decoding counters added up (per-position counts position by position)."""
    parts = [p for p in parts if p]
    if not parts:
        return {}
    total = {k: sum(p[k] for p in parts) for k in ("drafts", "proposed", "accepted", "emitted", "draft_pool_full")}
    return {"method": parts[0]["method"], **total,
            "per_position": [sum(c) for c in zip(*(p["per_position"] for p in parts))]}


K = TypeVar("K")


def sum_counts(parts: Iterable[Mapping[K, list[int]]]) -> dict[K, list[int]]:
    """Per-layer routing counts (layer -> count per expert) added up layer by layer, keys as given."""
    total: dict[K, list[int]] = {}
    for counts in parts:
        for layer, row in counts.items():
            acc = total.get(layer, [0] * len(row))
            total[layer] = [a + c for a, c in zip(acc, row)]
    return total


class CacheEvents(Msg):
    """A replica leader's news for the router (dp > 1): page digests that joined or left its prefix
    cache and requests that ended (finished, aborted or refused), in the order they happened.
    `seq` counts messages per replica, so the router notices one it missed."""

    replica: int
    seq: int
    stored: list[bytes] = []
    evicted: list[bytes] = []
    ended: list[str] = []


class RouterStats(Msg):
    """The in-server router's per-replica counts, for /metrics."""

    routed: list[int]
    prompt_tokens: list[int]
    in_flight: list[int]
    load_tokens: list[int]
