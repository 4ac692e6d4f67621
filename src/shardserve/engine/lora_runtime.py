"""One rank's LoRA adapters (--enable-lora): slots on its adapted layers, and parsed adapters kept
in host memory.

The leader decides everything (scheduler/lora_slots.py): which adapter goes into which slot, and
which parsed adapters the ranks keep (--max-cpu-loras, least recently used dropped first). A plan
carries those decisions; the first time an adapter reaches the ranks it carries the adapter's file
itself, so ranks on other machines need no copy of it and every rank loads the same bytes. A rank
parses the file once, keeps only its own shard of each matrix, and a slot load is then a copy.
"""

from __future__ import annotations

import torch
from safetensors.torch import load as load_safetensors

from shardserve.config import EngineConfig
from shardserve.distributed.communicator import Communicator
from shardserve.distributed.pipeline import Stage
from shardserve.ipc.messages.plan import DROP, LoraOp
from shardserve.layers.lora import LoraRows, LoraStep
from shardserve.loader.lora import TARGETS, base_shapes, parse_key, submodule, unfuse

# (layer, module) -> this rank's (A rows, Bt columns) of it.
Parsed = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class LoraRuntime:
    def __init__(self, model: torch.nn.Module, cfg: EngineConfig, comm: Communicator, stage: Stage,
                 dtype: torch.dtype, device: torch.device):
        self.step, self.device = LoraStep(), device
        self.targets: dict[tuple[int, str], tuple[torch.nn.Module, object]] = {}
        for i in range(stage.start, stage.end):
            for module in TARGETS:
                linear, shard = _target(model, i, module)
                if linear is None:
                    continue
                if linear.lora is None:
                    linear.make_lora(self.step, cfg.max_loras, cfg.max_lora_rank, comm, cfg.fully_sharded_loras,
                                     dtype, device)
                self.targets[(i, module)] = (linear, shard)
        self.adapted = list({id(lin): lin for lin, _ in self.targets.values()}.values())
        self.rows = {m: out for m, (_, out) in base_shapes(model.cfg).modules.items()}  # for unfuse
        self.cache: dict[int, Parsed] = {}  # which ones, the leader says (LoraOp): no order kept here

    def apply(self, ops: list[LoraOp]) -> None:
        """A plan's adapter decisions, in the leader's order, before it runs."""
        for op in ops:
            if op.slot == DROP:
                self.cache.pop(op.lora_id, None)
                continue
            if op.data:
                self.cache[op.lora_id] = self._parse(op.data, op.scale)
            parsed = self.cache[op.lora_id]  # KeyError: the leader's record of the cache is wrong
            for linear in self.adapted:
                linear.lora.clear(op.slot)
            for key, (a, bt) in parsed.items():
                linear, shard = self.targets[key]
                linear.lora.write(op.slot, shard, a, bt)

    def _parse(self, data: bytes, scale: float) -> Parsed:
        pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for name, t in load_safetensors(data).items():
            layer, module, ab = parse_key(name)  # the leader checked every name
            for part, m in unfuse(module, ab, t, self.rows):
                if (layer, part) in self.targets:
                    pieces.setdefault((layer, part), {})[ab] = m.float()
        out: Parsed = {}
        for key, ab in pieces.items():
            linear, shard = self.targets[key]
            out[key] = linear.lora.shard(shard, ab["A"], ab["B"], scale)
        return out

    def set_rows(self, per_row: list[int]) -> None:
        """This step's adapter slot per row (-1: base), for every adapted layer to read."""
        self.step.rows = LoraRows.of(per_row, self.device)


def _target(model: torch.nn.Module, layer: int, module: str) -> tuple[torch.nn.Module | None, object]:
    """The layer holding checkpoint projection `module` of decoder layer `layer` (a fused one, with
    its piece), where that layer takes adapters; else (None, None)."""
    found = model.weight_target(f"model.layers.{layer}.{submodule(module)}.weight")
    if found is None:
        return None, None
    name, shard = found
    try:
        linear = model.get_submodule(name.rsplit(".", 1)[0])
    except AttributeError:  # a MoE block's experts, say: no such dense projection
        return None, None
    return (linear, shard) if hasattr(linear, "make_lora") else (None, None)
