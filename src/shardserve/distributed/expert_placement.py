"""Where each MoE layer's experts live under expert parallelism, hot-expert replicas included.

A `Placement` lists, for every rank of the expert group, the logical expert held in each of its
local slots. Today's layout is `Placement.contiguous`: experts split whole and contiguously, one
slot each. `Placement.balanced` adds `redundant` extra slots holding copies of the experts that
routing counts (`save_counts` / `load_counts`, written by `shardserve record-experts`) show to be
hot, as DeepSeek's EPLB does: a token routed to a replicated expert goes to one of its copies
(layers/expert_dispatch.py), so the hot expert's tokens are shared by several ranks.

Pure python and torch: nothing here talks to a process group. Every rank computes the same
placement from the same inputs (the counts file must be readable on every node).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import cached_property

from shardserve.ipc.messages.reports import sum_counts


@dataclass(frozen=True)
class Placement:
    """One MoE layer's experts over the expert group's ranks.

    `slots[r][i]` is the logical expert in rank r's local slot i. Every expert has at least one
    slot, and no rank holds two copies of one expert (a second copy on the same rank would share
    no load)."""

    num_experts: int
    slots: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        seen: set[int] = set()
        for r, held in enumerate(self.slots):
            if len(set(held)) != len(held):
                raise ValueError(f"placement: rank {r} holds an expert twice: {held}")
            if any(not 0 <= e < self.num_experts for e in held):
                raise ValueError(f"placement: rank {r} holds an expert outside [0, {self.num_experts}): {held}")
            seen.update(held)
        if len(seen) != self.num_experts:
            missing = sorted(set(range(self.num_experts)) - seen)
            raise ValueError(f"placement: experts {missing} have no slot")

    @property
    def ranks(self) -> int:
        return len(self.slots)

    @property
    def num_slots(self) -> int:
        return sum(len(s) for s in self.slots)

    @cached_property
    def _owners(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        found: list[list[tuple[int, int]]] = [[] for _ in range(self.num_experts)]
        for r, held in enumerate(self.slots):
            for i, e in enumerate(held):
                found[e].append((r, i))
        return tuple(tuple(f) for f in found)

    def owners(self, expert: int) -> tuple[tuple[int, int], ...]:
        """The (rank, local slot) of every copy of `expert`, in rank order."""
        return self._owners[expert]

    def copies(self) -> list[int]:
        """How many slots hold each expert."""
        return [len(o) for o in self._owners]

    def expected_load(self, counts: list[int] | list[float]) -> list[float]:
        """Per rank, the token-expert pairs it computes if each expert's `counts` are shared
        evenly by its copies."""
        _check_counts(counts, self.num_experts)
        copies = self.copies()
        return [sum(counts[e] / copies[e] for e in held) for held in self.slots]

    def imbalance(self, counts: list[int] | list[float]) -> float:
        """max / mean of `expected_load`: 1.0 is perfectly even (and for no tokens at all)."""
        return max_over_mean(self.expected_load(counts))

    @staticmethod
    def contiguous(num_experts: int, ranks: int) -> Placement:
        """Experts split whole and contiguously, as even as possible (the first ranks get one
        more): expert parallelism without replicas."""
        if ranks > num_experts:
            raise ValueError(f"{num_experts} experts cannot be split over {ranks} ranks")
        # layers/sharding.split_range's arithmetic, written out: distributed/ sits below layers/
        # in the import order and does not import it (a test checks the two agree).
        base, extra = divmod(num_experts, ranks)
        starts = [r * base + min(r, extra) for r in range(ranks + 1)]
        return Placement(num_experts, tuple(tuple(range(starts[r], starts[r + 1])) for r in range(ranks)))

    @staticmethod
    def balanced(counts: list[int], ranks: int, redundant: int) -> Placement:
        """The contiguous placement plus `redundant` copies of the hottest experts.

        Greedy, one extra slot at a time: take the expert with the largest count / copies (ties:
        lower expert) and put the copy on the least-loaded rank (load = sum over its slots of
        count / copies; ties: lower rank) that does not hold that expert yet and has fewer than
        ceil(redundant / ranks) extra slots. That cap is deliberate: every slot is a whole
        expert's weights, and the KV pool is sized by the rank with the least free memory, so
        extras piled on one rank would shrink every rank's pool; capped, the memory cost is even.
        Its price: once lighter ranks are full, the last extras may land on a busy rank, so a
        multiple of `ranks` (every rank the same number of slots, as DeepSeek's EPLB) is best.
        When no rank can take the chosen expert, the next one in that order is taken instead."""
        num_experts = len(counts)
        _check_counts(counts, num_experts)
        if redundant < 0:
            raise ValueError(f"redundant experts must be >= 0, got {redundant}")
        base = Placement.contiguous(num_experts, ranks)
        if redundant > num_experts * (ranks - 1):
            raise ValueError(f"{redundant} redundant experts: {num_experts} experts on {ranks} ranks have room "
                             f"for at most {num_experts * (ranks - 1)} copies (one per expert per rank)")
        cap = math.ceil(redundant / ranks) if redundant else 0
        slots = [list(s) for s in base.slots]
        copies = [1] * num_experts
        extras = [0] * ranks
        for _ in range(redundant):
            load = [sum(counts[e] / copies[e] for e in held) for held in slots]
            placed = False
            for e in sorted(range(num_experts), key=lambda e: (-counts[e] / copies[e], e)):
                free = [r for r in range(ranks) if extras[r] < cap and e not in slots[r]]
                if free:
                    r = min(free, key=lambda r: (load[r], r))
                    slots[r].append(e)
                    copies[e] += 1
                    extras[r] += 1
                    placed = True
                    break
            if not placed:
                raise ValueError(f"{redundant} redundant experts do not fit {num_experts} experts on {ranks} ranks "
                                 f"with at most {cap} extra per rank")
        return Placement(num_experts, tuple(tuple(s) for s in slots))


def max_over_mean(loads: list[float] | list[int]) -> float:
    """How uneven per-rank loads are: max / mean (1.0 when even, or when all are zero)."""
    mean = sum(loads) / len(loads) if loads else 0
    return max(loads) / mean if mean else 1.0


def _check_counts(counts, num_experts: int) -> None:
    if len(counts) != num_experts:
        raise ValueError(f"routing counts for {len(counts)} experts, expected {num_experts}")
    if any(c < 0 for c in counts):
        raise ValueError("routing counts must be >= 0")


@dataclass(frozen=True)
class RoutingCounts:
    """A routing-count file's contents: per MoE layer, how many token-expert pairs chose each
    expert."""

    num_experts: int
    model: str
    layers: dict[int, list[int]]


def layer_counts(reports: list[dict], layout) -> dict[int, list[int]]:
    """Routing counts per MoE layer over the whole grid from rank reports, each token counted
    once: only tensor rank 0 of each tensor group counts (its peers routed the same tokens)."""
    ones = (r.get("experts", {}).get("routed", {}) for r in reports if layout.coords(r["rank"]).tp == 0)
    return {int(layer): row for layer, row in sum_counts(ones).items()}


def save_counts(path: str, counts_per_layer: dict[int, list[int]], num_experts: int, model: str) -> None:
    """Write {"num_experts": E, "model": name, "layers": {"<layer>": [count per expert]}}."""
    for layer, counts in counts_per_layer.items():
        if len(counts) != num_experts:
            raise ValueError(f"layer {layer}: {len(counts)} counts, expected {num_experts}")
    body = {"num_experts": num_experts, "model": model,
            "layers": {str(layer): [int(c) for c in counts] for layer, counts in sorted(counts_per_layer.items())}}
    with open(path, "w") as f:
        json.dump(body, f)
        f.write("\n")


def load_counts(path: str, num_experts: int | None = None) -> RoutingCounts:
    """Read a file `save_counts` wrote; with `num_experts`, also check it matches the model's.
    Every problem is a one-line ValueError naming the file."""
    if not os.path.isfile(path):
        raise ValueError(f"expert placement file {path} does not exist")
    try:
        with open(path) as f:
            body = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"expert placement file {path} is not valid JSON: {e}") from None
    try:
        stored = int(body["num_experts"])
        model = str(body.get("model", ""))
        layers = {int(k): [int(c) for c in v] for k, v in body["layers"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"expert placement file {path} is not a routing-count file "
                         f"(want num_experts, model, layers): {type(e).__name__}: {e}") from None
    if num_experts is not None and stored != num_experts:
        raise ValueError(f"expert placement file {path} counts {stored} experts, the model has {num_experts}")
    for layer, counts in layers.items():
        if len(counts) != stored or any(c < 0 for c in counts):
            raise ValueError(f"expert placement file {path}: layer {layer} has {len(counts)} counts, "
                             f"expected {stored} non-negative ones")
    return RoutingCounts(stored, model, layers)


class PlacementPlan:
    """Every MoE layer's placement for one expert group of `ranks` ranks."""

    def __init__(self, ranks: int, redundant: int = 0, counts_per_layer: dict[int, list[int]] | None = None):
        if redundant < 0:
            raise ValueError(f"--ep-num-redundant-experts must be >= 0, got {redundant}")
        if redundant and counts_per_layer is None:
            raise ValueError("--ep-num-redundant-experts needs --ep-expert-placement "
                             "(write one with shardserve record-experts)")
        self.ranks, self.redundant, self.counts = ranks, redundant, counts_per_layer

    def for_layer(self, layer: int, num_experts: int) -> Placement:
        if not self.redundant:
            return Placement.contiguous(num_experts, self.ranks)
        counts = self.counts.get(layer) if self.counts else None
        if counts is None:
            raise ValueError(f"--ep-expert-placement has no routing counts for MoE layer {layer}")
        if len(counts) != num_experts:
            raise ValueError(f"--ep-expert-placement: layer {layer} has {len(counts)} counts, "
                             f"the model has {num_experts} experts")
        return Placement.balanced(counts, self.ranks, self.redundant)
