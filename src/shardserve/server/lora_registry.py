"""The adapters a server serves by name (--enable-lora): the request's `model` picks one, as in
vLLM, and /v1/load_lora_adapter and /v1/unload_lora_adapter change the set while serving.

Each loaded adapter gets an id of its own for the server's life, so one unloaded and loaded again
(perhaps with other weights) never shares a slot, a parsed copy or a prefix-cache page with its
old self. Unloading only removes the name: requests already running keep their adapter and finish
as they began (the scheduler holds the adapter while any request needs it).
"""

from __future__ import annotations

import threading
import time
from typing import ClassVar

from shardserve.loader.lora import BaseShapes, base_shapes, parse_lora_module, read_adapter
from shardserve.sampling_params import LoRARequest
from shardserve.server.errors import APIError
from shardserve.server.protocol import Refusing


class LoadLoraRequest(Refusing):
    """POST /v1/load_lora_adapter, as vLLM takes it: `load_inplace` replaces an adapter already
    loaded under that name (requests running with the old one finish with it)."""

    not_honoured: ClassVar[dict[str, tuple[tuple, str]]] = {
        "is_3d_lora_weight": ((False,), "adapters on a MoE block's stacked expert weights are not supported")}
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraRequest(Refusing):
    """POST /v1/unload_lora_adapter; `lora_int_id` (vLLM's), if given, must be the adapter's id."""

    lora_name: str
    lora_int_id: int | None = None


class LoraRegistry:
    def __init__(self, base_name: str, base: BaseShapes | None, max_rank: int):
        """`base`: None where the server runs no adapters (without --enable-lora)."""
        self.base_name, self.base, self.max_rank = base_name, base, max_rank
        self.adapters: dict[str, tuple[LoRARequest, int]] = {}  # name -> (request, created)
        self.next_id = 1
        self._lock = threading.Lock()  # loads run in worker threads (they read files)

    @classmethod
    def at_start(cls, name: str, cfg, model_cfg, modules: list[str]) -> LoraRegistry:
        """The registry of a server starting: `cfg` the EngineConfig, `modules` --lora-modules'
        NAME=PATH items, each checked now (ValueError, one line) before any worker starts."""
        if not cfg.enable_lora:
            if modules:
                raise ValueError("--lora-modules needs --enable-lora")
            return cls(name, None, 0)
        registry = cls(name, base_shapes(model_cfg), cfg.max_lora_rank)
        for item in modules:
            registry.load(*parse_lora_module(item))
        return registry

    @property
    def enabled(self) -> bool:
        return self.base is not None

    def load(self, name: str, path: str, inplace: bool = False) -> LoRARequest:
        """Check and add an adapter; ValueError (one line naming it) if it cannot be served.
        `inplace`: a new adapter under a name already loaded replaces it (a new id: nothing of the
        old one is used for it), once it is checked."""
        if not self.enabled:
            raise ValueError("this server runs no LoRA adapters: start it with --enable-lora")
        if not name or name == self.base_name:
            raise ValueError(f"a LoRA adapter cannot be named {name!r} (the base model's name, or empty)")
        with self._lock:
            if name in self.adapters and not inplace:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded (unload it first, or load it "
                                 "with load_inplace)")
            spec = read_adapter(name, path, self.base, self.max_rank)
            lora = LoRARequest(name, self.next_id, spec.path)
            self.next_id += 1
            self.adapters[name] = (lora, int(time.time()))
            return lora

    def unload(self, name: str, lora_int_id: int | None = None) -> None:
        """KeyError where no adapter of that name (and, if given, that id) is loaded."""
        with self._lock:
            found = self.adapters.get(name)
            if found is None or (lora_int_id is not None and found[0].lora_int_id != lora_int_id):
                raise KeyError(name)
            del self.adapters[name]

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); a 404 for another name."""
        if model is None or model == self.base_name:
            return None
        found = self.adapters.get(model)
        if found is None:
            served = ", ".join(repr(n) for n in [self.base_name, *self.adapters])
            raise APIError(404, f"the model {model!r} does not exist; this server serves {served}", param="model")
        return found[0]

    def cards(self, max_model_len: int) -> list[dict]:
        """/v1/models' entries for the adapters (vLLM's shape: `parent` is the base model)."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "shardserve", "root": lora.lora_path,
                 "parent": self.base_name, "max_model_len": max_model_len}
                for name, (lora, created) in self.adapters.items()]
