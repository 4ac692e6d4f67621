"""The leader's LoRA adapter slots (--enable-lora): which adapter sits in which slot, and what the
ranks keep parsed in host memory (engine/lora_runtime.py follows these decisions, plan by plan).

- A request names its adapter when it arrives; the leader reads and checks the adapter then, so a
  bad one is refused at once and one on disk is read once (`register`). The file's bytes are kept
  while a request needs them or the ranks keep the adapter parsed.
- A waiting request is admitted only into a slot holding its adapter (`acquire`): an empty slot,
  or the least recently used one no running request holds. With every slot held by running
  requests it waits, and is never run with another adapter; the least recently used slot then
  drains (no new request of its adapter is admitted until its running ones end), so it cannot wait
  forever behind a steady stream of another adapter. Each running request holds its slot until it
  ends or is preempted (`release`).
- The ranks keep up to --max-cpu-loras adapters parsed; the least recently used (by requests
  admitted) is dropped past that, and an adapter they dropped is sent again with its next load. The
  plan carries these decisions in the order they were taken (`StepPlan.lora_ops`).
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict

from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from shardserve.ipc.messages.plan import DROP, LoraOp
from shardserve.loader.lora import WEIGHTS, AdapterSpec, BaseShapes, read_adapter
from shardserve.sampling_params import LoRARequest
from shardserve.scheduler.plan_feed import PlanFeed


class LoraSlots:
    def __init__(self, slots: int, cpu_loras: int, max_rank: int, base: BaseShapes, feed: PlanFeed):
        self.max_rank, self.base, self.feed = max_rank, base, feed
        self.cpu_loras = cpu_loras
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.free = list(range(slots))
        self.holders: Counter[int] = Counter()  # running requests per adapter id
        self.wanted: Counter[int] = Counter()  # requests (waiting or running) per adapter id
        self.specs: dict[int, tuple[LoRARequest, AdapterSpec, bytes]] = {}  # adapters the engine may still need
        self.parsed: OrderedDict[int, None] = OrderedDict()  # what the ranks keep parsed, LRU first
        # An adapter whose slot a waiting request needs: no new request takes it until it drains,
        # so a steady stream of one adapter cannot keep another's requests waiting forever.
        self.draining: int | None = None
        self.loads = 0  # slot loads so far (a test and /metrics can see eviction work)

    def register(self, lora: LoRARequest) -> None:
        """A request for `lora` arrived: read and check the adapter unless it is held already
        (ValueError, one line naming it, for a bad one)."""
        i = lora.lora_int_id
        held = self.specs.get(i)
        if held is not None and held[0] != lora:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: lora_int_id {i} is already in use by adapter "
                             f"{held[0].lora_name!r} at {held[0].lora_path}; each adapter needs an id of its own")
        if held is None:
            where = os.path.join(lora.lora_path, WEIGHTS)
            try:
                with open(where, "rb") as f:
                    data = f.read()
            except OSError as e:
                read_adapter(lora.lora_name, lora.lora_path, self.base, self.max_rank)  # names a missing piece
                raise ValueError(f"LoRA adapter {lora.lora_name!r}: cannot read {where}: {e}") from None
            # Checked from the very bytes the ranks will get, which every rank parses: a broken
            # file stops here, not on a rank.
            spec = read_adapter(lora.lora_name, lora.lora_path, self.base, self.max_rank, data)
            try:
                load_safetensors(data)
            except SafetensorError as e:
                raise ValueError(f"LoRA adapter {lora.lora_name!r}: cannot read {where}: {e}") from None
            self.specs[i] = (lora, spec, data)
        self.wanted[i] += 1

    def unregister(self, lora: LoRARequest) -> None:
        """A request for `lora` ended (or failed to be added after `register`)."""
        i = lora.lora_int_id
        self.wanted[i] -= 1
        if self.wanted[i] <= 0:
            del self.wanted[i]
            if i not in self.parsed:
                self.specs.pop(i, None)

    def acquire(self, lora: LoRARequest) -> int | None:
        """The slot a request for `lora` runs in, loading it there if need be; None while every
        slot is held by running requests of other adapters (or its own is draining)."""
        i = lora.lora_int_id
        if i == self.draining:
            if self.holders[i]:
                return None
            self.draining = None  # drained, and no one else took the slot first
        slot = self.slot_of.get(i)
        if slot is None:
            slot = self._take_slot()
            if slot is None:
                return None
            self._load(i, slot)
        self.slot_of.move_to_end(i)
        if i in self.parsed:
            self.parsed.move_to_end(i)
        self.holders[i] += 1
        return slot

    def release(self, lora: LoRARequest) -> None:
        i = lora.lora_int_id
        self.holders[i] -= 1
        if self.holders[i] <= 0:
            del self.holders[i]

    def _take_slot(self) -> int | None:
        if self.free:
            return self.free.pop(0)
        for i, slot in self.slot_of.items():  # least recently used first
            if not self.holders[i]:
                del self.slot_of[i]
                if i == self.draining:
                    self.draining = None
                return slot
        if self.draining is None:  # drain the least recently used slot for the request that waits
            self.draining = next(iter(self.slot_of))
        return None

    def _load(self, i: int, slot: int) -> None:
        _, spec, data = self.specs[i]
        send = i not in self.parsed
        self.parsed[i] = None
        self.parsed.move_to_end(i)
        self.feed.lora_ops.append(LoraOp(slot, i, spec.scale, data if send else b""))
        self.slot_of[i] = slot
        self.loads += 1
        while len(self.parsed) > self.cpu_loras:
            old = next(iter(self.parsed))
            del self.parsed[old]
            self.feed.lora_ops.append(LoraOp(DROP, old))
            if old not in self.wanted:
                self.specs.pop(old, None)
