"""Which replica gets a request: round_robin, least_load, or cache_aware.

Every policy sees the same numbers per replica (`ReplicaState`): the prompt tokens it already
holds for this request (from its `PrefixIndex`) and its outstanding load, in tokens. Load is
counted when a request is sent (its prompt tokens the replica must still prefill, plus the decode
tokens it may ask for) and released when the request finishes, so a burst of arrivals spreads
before any replica has reported anything.

cache_aware (the default), in order:
1. Imbalanced: if the most and least loaded healthy replicas differ by more than
   `balance_abs_tokens` AND the most loaded carries more than `balance_rel` times the least,
   send to the least loaded (sgl-router's rule: both thresholds, so small absolute gaps between
   idle replicas never override affinity, nor do large relative gaps between tiny loads).
2. Otherwise score each replica by `cached_tokens - load_weight * load` (plus `adapter_tokens`
   where the request's LoRA adapter last went, which likely holds it in a slot) and take the best;
   ties go to the lower load, then the smaller prefix index (more room, and a prompt no replica
   holds starts a new one's cache, as sgl-router sends it to its smallest tree), then the lower index.

Defaults (`Thresholds`): balance_abs_tokens 2048, balance_rel 1.5, load_weight 0.5 (a cached
prompt token saves roughly a prefill token of work; outstanding tokens mix prefill and decode,
so they count half), decode_estimate 256 (the decode tokens a request without max_tokens is
assumed to ask for), adapter_tokens 512 (a slot load saved is worth about a short prefill).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from shardserve.router.prefix_index import PrefixIndex

POLICIES = ("cache_aware", "least_load", "round_robin")


def resolve_policy(method: str | None, replicas: int, lockstep: bool = False) -> str:
    """The policy a grid of `replicas` uses: `method`, or by default cache_aware (least_load for
    data-parallel attention's `lockstep` replicas, where the slowest replica paces every step). A
    method given with one replica would be ignored, so it is refused."""
    if method is None:
        return "least_load" if lockstep else "cache_aware"
    if method not in POLICIES:
        raise ValueError(f"--load-balance-method must be one of {', '.join(POLICIES)}, got {method!r}")
    if replicas == 1:
        raise ValueError(f"--load-balance-method {method} needs --dp-size > 1 (one replica gets every request)")
    return method


@dataclass(frozen=True)
class Thresholds:
    balance_abs_tokens: int = 2048
    balance_rel: float = 1.5
    load_weight: float = 0.5
    decode_estimate: int = 256
    adapter_tokens: int = 512


@dataclass
class ReplicaState:
    index: int
    prefixes: PrefixIndex
    load: int = 0  # outstanding tokens: counted on send, released on finish
    routed: int = 0  # requests sent here so far
    prompt_tokens: int = 0  # their prompt tokens (how evenly prefill work is spread)
    in_flight: int = 0
    healthy: bool = True


@dataclass
class Routed:
    """What the router remembers of a request until it finishes."""

    replica: int
    cost: int
    pages: list[bytes] = field(default_factory=list)  # pages claimed as pending in the replica's index


class Router:
    """The policy plus its bookkeeping. `route` picks and counts; `finish` releases."""

    def __init__(self, num_replicas: int, policy: str = "cache_aware", page_size: int = 16,
                 thresholds: Thresholds = Thresholds(), max_pages: int | None = None, units_per_token: float = 1.0):
        """Prompts and pages are measured in units: tokens, or characters for a router without the
        model's tokenizer (`units_per_token` about 4); loads and thresholds are always in tokens, so
        the same thresholds hold either way."""
        if policy not in POLICIES:
            raise ValueError(f"unknown load-balance policy {policy!r} (choose from {', '.join(POLICIES)})")
        self.policy, self.page_size, self.t = policy, page_size, thresholds
        self.units_per_token = units_per_token
        self.replicas = [ReplicaState(i, PrefixIndex(max_pages)) for i in range(num_replicas)]
        self.requests: dict[str, Routed] = {}
        self.adapter_home: dict[int, int] = {}  # LoRA adapter id -> the replica its last request went to
        self._rr = itertools.count()

    def route(self, rid: str, pages: list[bytes], prompt_len: int, max_tokens: int | None,
              confirmed: bool = False, adapter: int | None = None) -> int:
        """Pick a replica for request `rid` whose prompt's full pages have the chained digests
        `pages`; count its load there and credit its pages to that replica (pending until the
        replica reports them stored, or at once with `confirmed`, for workers that report nothing).
        `adapter`: the id of the LoRA adapter it runs with, if any."""
        healthy = [r for r in self.replicas if r.healthy]
        if not healthy:
            raise NoReplica("no healthy replica to send the request to")
        per = self.units_per_token
        cached = {r.index: min(r.prefixes.match(pages) * self.page_size, max(prompt_len - 1, 0)) / per
                  for r in healthy}
        home = self.adapter_home.get(adapter) if adapter is not None else None
        chosen = self._choose(healthy, cached, home)
        if adapter is not None:
            self.adapter_home[adapter] = chosen.index
        decode = max_tokens if max_tokens is not None else self.t.decode_estimate
        cost = round(prompt_len / per - cached[chosen.index]) + decode
        claimed = chosen.prefixes.claim(pages, confirmed)
        chosen.load += cost
        chosen.routed += 1
        chosen.prompt_tokens += round(prompt_len / per)
        chosen.in_flight += 1
        self.requests[rid] = Routed(chosen.index, cost, claimed)
        return chosen.index

    def _choose(self, healthy: list[ReplicaState], cached: dict[int, float], home: int | None) -> ReplicaState:
        def least(r: ReplicaState):
            return (r.load, r.index)

        if self.policy == "round_robin":
            return healthy[next(self._rr) % len(healthy)]
        if self.policy == "least_load" or self.imbalanced(healthy):
            return min(healthy, key=least)
        bonus = {home: self.t.adapter_tokens}
        return max(healthy, key=lambda r: (cached[r.index] + bonus.get(r.index, 0) - self.t.load_weight * r.load,
                                           -r.load, -len(r.prefixes), -r.index))

    def imbalanced(self, healthy: list[ReplicaState]) -> bool:
        hi, lo = max(r.load for r in healthy), min(r.load for r in healthy)
        return hi - lo > self.t.balance_abs_tokens and hi > self.t.balance_rel * lo

    def finish(self, rid: str) -> int | None:
        """Release a finished (or failed, or aborted) request; returns its replica, if known."""
        routed = self.requests.pop(rid, None)
        if routed is None:
            return None
        r = self.replicas[routed.replica]
        r.load -= routed.cost
        r.in_flight -= 1
        r.prefixes.unclaim(routed.pages)
        return routed.replica

    def replica_of(self, rid: str) -> int | None:
        routed = self.requests.get(rid)
        return routed.replica if routed is not None else None


class NoReplica(RuntimeError):
    """Every replica (or worker) is down."""
