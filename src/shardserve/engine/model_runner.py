"""One rank's model: build it, stream its weights in, size its KV pool, run a batch forward.

Under pipeline parallelism the rank holds only its stage's layers (and their KV pool); the first
stage embeds token ids, later stages start from the previous stage's residual stream, and only
the last stage applies the final norm and LM head.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from shardserve.attention import cpu_kernel
from shardserve.attention.backend import AttentionBackend
from shardserve.attention.context import ContextBackend
from shardserve.attention.metadata import AttentionMetadata
from shardserve.attention.select import choose_backend
from shardserve.config import EngineConfig, ModelConfig
from shardserve.distributed.expert_placement import PlacementPlan, load_counts
from shardserve.distributed.groups import ParallelGroups, single_process_groups
from shardserve.distributed.pipeline import Stage
from shardserve.engine.lora_runtime import LoraRuntime
from shardserve.kvcache.budget import kv_budget_message
from shardserve.kvcache.pool import KVPool
from shardserve.layers import quant_kernel
from shardserve.layers.attention import ForwardContext
from shardserve.layers.moe import SparseMoE
from shardserve.layers.sharding import head_shard
from shardserve.loader.model_path import Checkpoint
from shardserve.loader.weights import checkpoint_sources, load_weights, resolve_dtype
from shardserve.models.registry import model_class
from shardserve.multimodal import ImageInput
from shardserve.platform import available_memory, pick_device

if TYPE_CHECKING:
    from shardserve.engine.context_inputs import ContextStep

log = logging.getLogger(__name__)


def kv_cache_dtype(asked: str, compute: torch.dtype, bf16_weights: bool, backend: AttentionBackend,
                   widths: tuple[int, int]) -> torch.dtype:
    """The KV pool's dtype for --kv-cache-dtype `asked` (config.KV_CACHE_DTYPES), decided once per
    runner before any weight loads: the compute dtype, or bfloat16 on the CPU where the C attention
    kernel reads such a cache (half the bytes a decode step's attention reads) and either it is
    asked for or, under --dtype bfloat16, the products take bfloat16 activations anyway. Raises
    ValueError naming the flag where the asked dtype cannot be had."""
    readable = compute == torch.float32 and backend.name == "cpu" and cpu_kernel.bf16_cache(widths)
    if asked == "auto":
        return torch.bfloat16 if bf16_weights and quant_kernel.bf16_activations() and readable else compute
    want = torch.bfloat16 if asked == "bfloat16" else torch.float32
    if want == compute or (want == torch.bfloat16 and readable):
        return want
    if want == torch.float32:
        raise ValueError(f"--kv-cache-dtype float32 needs float32 compute, got {str(compute).removeprefix('torch.')}")
    cpu = "has" if cpu_kernel.bf16_cache((64, 64)) else "lacks"
    named = "context (context parallelism)" if backend.name == "context" else backend.name
    raise ValueError(f"--kv-cache-dtype bfloat16 needs the cpu attention backend, AVX512-BF16 and K/V heads of one "
                     f"width, a multiple of 32 up to 256; here: backend {named}, this CPU {cpu} AVX512-BF16, heads "
                     f"{widths[0]}/{widths[1]}")


@dataclass
class StepInputs:
    """One micro-batch, flat: decodes first, then prefill chunks laid end to end."""

    token_ids: list[int]  # the tokens to embed (first stage only; empty elsewhere)
    positions: list[int]
    decodes: list[tuple[list[int], int]]  # (pages, context length)
    prefills: list[tuple[list[int], int, int]]  # (pages, tokens, context length after them)
    logit_rows: list[int]  # rows that need logits (sampled, then prompt-scored)
    context: ContextStep | None = None  # context parallelism: this rank's rows (then the above are unused)
    hidden_rows: list[int] = field(default_factory=list)  # rows whose final hidden states are pooled
    hidden: torch.Tensor | None = None  # filled by forward on the last stage: those rows, float32
    lora_slots: list[int] = field(default_factory=list)  # --enable-lora: each row's adapter slot (-1: none)
    # Images: per prefill chunk, None or each row's context length as it attends (multimodal.py);
    # on the first stage, (image, first batch row, first of its tokens, count) of the rows it fills.
    horizons: list[list[int] | None] = field(default_factory=list)
    images: list[tuple[ImageInput, int, int, int]] = field(default_factory=list)


class ModelRunner:
    """Owns the model and the KV pool of one rank."""

    def __init__(self, cfg: EngineConfig, ckpt: Checkpoint, model_cfg: ModelConfig,
                 groups: ParallelGroups | None = None, stage: Stage | None = None):
        self.cfg = cfg = resolve_dtype(cfg, ckpt, model_cfg)  # a no-op where the engine core did it
        # What depends on the served length (LongRoPE's factor set) is fixed here, for every layer.
        served = model_cfg.served_length(cfg.max_model_len)
        self.model_cfg = model_cfg = model_cfg.serving(served)
        groups = groups or single_process_groups()
        self.groups = groups
        self.stage = stage or Stage(0, 1, 0, model_cfg.num_layers)
        self.comm, self.control = groups.tensor, groups.control
        self.device = pick_device(cfg.device, groups.local_rank)
        if self.device.type == "cuda":  # Triton launches on the current device, a lone rank's too
            torch.cuda.set_device(self.device)
        self.dtype = cfg.torch_dtype
        # --dtype bfloat16 on the CPU: bfloat16 weights for the C kernels, float32 around them
        # (activations, norms), so the C decode loop and attention kernel run it.
        self.bf16_weights = quant_kernel.bf16_weights(self.device, self.dtype)
        if self.bf16_weights:
            self.dtype = torch.float32
        # Sliding-window attention where the served context passes the window (within one
        # window, full attention is the same arithmetic and costs nothing extra).
        window = model_cfg.attention_window
        self.window = window if window is not None and served > window else None
        # Some layers windowed, others not (Gemma, Qwen2's max_window_layers): each step is
        # described twice, once per kind of layer.
        self.split_window = self.window is not None and bool(model_cfg.full_layers)
        # Chosen once, before any weight loads; the layers call whichever it is.
        backend = choose_backend(cfg.attention_backend, self.device, self.dtype, cfg.batch_invariant, self.window,
                                 model_cfg.attn_logit_softcap)
        self.attention: AttentionBackend = ContextBackend(backend) if groups.context.size > 1 else backend
        if self.window and not self.attention.windows:  # launch/checks refuses it before any process starts
            raise ValueError(f"context parallelism (--cp-size) has no sliding-window attention (the model's window "
                             f"is {self.window} tokens): give --max-model-len {self.window} or less")
        if model_cfg.attn_logit_softcap and groups.context.size > 1:  # likewise
            raise ValueError("context parallelism (--cp-size) has no attention logit softcapping")
        self.kv_dtype = kv_cache_dtype(cfg.kv_cache_dtype, self.dtype, self.bf16_weights, self.attention,
                                       model_cfg.kv_widths)
        cls = model_class(model_cfg.architecture)
        self.placements = self._placement_plan()
        # Progress for the steps that take seconds, from one rank (the others do the same).
        say = log.info if groups.rank == 0 else log.debug
        say("%s: building the %s model (%d layers here) on %s ...", groups.label, model_cfg.architecture,
            self.stage.end - self.stage.start, self.device)
        with torch.device(self.device):
            self.model = cls(model_cfg, self.comm, self.dtype, self.device, self.stage, expert=groups.expert,
                             placements=self.placements)
        self.quantization = self._pick_quantization(ckpt)
        sources, total = checkpoint_sources(ckpt, self.quantization)
        say("%s: loading %d tensors of %s ...", groups.label, total, ckpt.name)
        desc = f"[{groups.label}] Loading {ckpt.name}"
        load_weights(self.model, sources, total, progress=cfg.show_progress, desc=desc)
        self.model.eval()
        self.lora = (LoraRuntime(self.model, cfg, self.comm, self.stage, self.dtype, self.device)
                     if cfg.enable_lora else None)
        shard = head_shard(model_cfg.num_heads, model_cfg.num_kv_heads, self.comm.size, self.comm.rank)
        pages = cfg.num_pages or self._pages_from_budget(shard.num_kv)
        # Every rank must schedule identically, so all use the smallest pool any rank can hold.
        self.num_pages = int(self.control.all_reduce(torch.tensor([pages]), op="min")[0])
        st = self.stage
        self.pool = KVPool(st.end - st.start, self.num_pages, cfg.page_size, shard.num_kv,
                           model_cfg.kv_widths, self.kv_dtype, self.device)
        # Indexed by global layer number; other stages' layers have no cache here.
        self.kv_views = [None] * st.start + self.pool.layer_views() + [None] * (model_cfg.num_layers - st.end)

    def _placement_plan(self) -> PlacementPlan | None:
        """Where MoE experts live over the expert group: None without expert parallelism (tensor
        parallelism splits experts contiguously), else contiguous plus the configured hot-expert
        replicas, placed from the routing-count file."""
        redundant, path = self.cfg.ep_num_redundant_experts, self.cfg.ep_expert_placement
        ranks = self.groups.expert.size
        if ranks <= 1:
            if redundant:
                raise ValueError("--ep-num-redundant-experts needs --ep-size > 1")
            return None
        counts = load_counts(path, self.model_cfg.num_experts).layers if path else None
        return PlacementPlan(ranks, redundant, counts)

    def expert_counts(self) -> dict:
        """Routing counts since start-up over this rank's MoE layers (empty for a dense model):
        {"routed": {layer: [pairs its gate sent to each logical expert]}, "computed": {layer:
        pairs its expert slots computed (its expert load)}, and under expert parallelism
        "rows_to": {layer: rows dispatched to each expert-group rank}}. Every rank of a tensor
        group routes every token, so one rank's "routed" is its replica's full count.
        """
        moes = [(i, layer.mlp) for i, layer in enumerate(self.model.layers)
                if isinstance(getattr(layer, "mlp", None), SparseMoE)]
        if not moes:
            return {}
        counts = {"routed": {i: [int(c) for c in m.routed.tolist()] for i, m in moes},
                  "computed": {i: m.computed for i, m in moes}}
        if moes[0][1].dispatch is not None:  # rows sent to each expert-group rank
            counts["rows_to"] = {i: list(m.dispatch.rows_to) for i, m in moes}
        return counts

    @property
    def weight_mb(self) -> float:
        """MB of the weights this rank holds (each tensor once: a tied head shares the embedding)."""
        seen = {}
        for m in self.model.modules():
            for k, v in vars(m).items():
                for t in _tensors(v) if k != "_modules" else ():
                    with contextlib.suppress(RuntimeError):  # a tensor with no storage holds no weights
                        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return round(sum(seen.values()) / 1e6, 1)

    def _pick_quantization(self, ckpt: Checkpoint) -> str:
        """What the loader offers the layers: "auto" (a GGUF's blocks), "int8", "bf16" (float
        weights as bfloat16 rows: `bf16_weights`), or "none"."""
        choice = self.cfg.quantization
        floats = "bf16" if self.bf16_weights else "none"  # what unquantized weights are offered as
        if choice == "int8" and ckpt.is_gguf:
            raise ValueError("quantization 'int8' quantizes a float (safetensors) checkpoint; a GGUF keeps its own "
                             "formats ('auto') or is expanded ('none')")
        if choice == "none" or (choice == "auto" and not ckpt.is_gguf):
            return floats
        why = None
        if self.bf16_weights:  # asked for bfloat16 weights: a GGUF's blocks are not bfloat16
            why = "--dtype bfloat16 asks for bfloat16 weights (--dtype float32 keeps the blocks)"
        elif self.device.type != "cpu" or self.dtype != torch.float32:
            why = f"the block-quantized kernels run on the CPU in float32, not {self.device.type} {self.cfg.dtype}"
        else:
            why = quant_kernel.available()
        if why is None:
            return choice
        if choice == "int8":
            raise ValueError(f"quantization 'int8': {why}")
        log.warning("GGUF weights are expanded to %s: %s", self.cfg.dtype, why)
        return floats

    def _pages_from_budget(self, num_kv_heads: int) -> int:
        """`kv_cache_memory` <= 1 is a fraction of free device memory; above 1 it is bytes."""
        budget = self.cfg.kv_cache_memory
        if budget <= 1:
            budget *= available_memory(self.device)
        per_token = self.model_cfg.kv_values_per_token(num_kv_heads, self.stage.end - self.stage.start)
        per_page = self.cfg.page_size * per_token * torch.empty((), dtype=self.kv_dtype).element_size()
        pages = int(budget // per_page)
        if pages < 1:
            raise ValueError(kv_budget_message(self.cfg.kv_cache_memory, budget, per_page, self.cfg.page_size))
        return pages

    @torch.inference_mode()
    def forward(self, step: StepInputs, hidden: torch.Tensor | None = None,
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """The first stage embeds `step.token_ids`, a later one continues from `hidden`. Returns the
        residual stream to send on, or on the last stage the logits of `step.logit_rows`.
        `after_layer(i)` runs once layer i has (disaggregated prefill: its KV leaves then)."""
        cp = step.context
        ctx = ForwardContext(self.kv_views, cp.meta if cp else self._prepare(step, full=self.split_window),
                             self.attention, after_layer=after_layer)
        if self.split_window and not cp:
            ctx.attn_window = self._prepare(step, full=False)
        pos = torch.tensor(step.positions, dtype=torch.long, device=self.device)
        ids = torch.tensor(step.token_ids, dtype=torch.long, device=self.device) if self.stage.first else None
        if self.lora is not None:
            self.lora.set_rows(step.lora_slots)
        out = self.model(ids, pos, ctx, hidden, self._image_embeds(step.images))
        if not self.stage.last:
            return out
        if cp:
            return self._context_logits(out, cp)
        if step.hidden_rows:  # embeddings: the final-normed hidden states themselves
            keep = torch.tensor(step.hidden_rows, dtype=torch.long, device=self.device)
            step.hidden = out.index_select(0, keep).float()
        # Only rows that sample (or score a prompt) need logits: the LM head is the largest matmul.
        rows = torch.tensor(step.logit_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(out.index_select(0, rows))

    def _prepare(self, step: StepInputs, full: bool) -> AttentionMetadata:
        """The step's attention metadata: for full attention, or under the model's window."""
        return self.attention.prepare(self.cfg.page_size, step.decodes, step.prefills, self.device,
                                      None if full else self.window, step.horizons or None)

    def _image_embeds(self, images: list[tuple[ImageInput, int, int, int]]
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows the step's images fill and their vectors, the vision encoder's output (each
        image encoded alone, so its vectors never depend on what shares the step)."""
        if not images:
            return None
        rows, parts = [], []
        for im, row, first, count in images:
            pixels = torch.frombuffer(bytearray(im.pixels), dtype=torch.uint8).view(1, im.size, im.size, 3)
            parts.append(self.model.encode_images(pixels.to(self.device))[0, first : first + count])
            rows.extend(range(row, row + count))
        return torch.tensor(rows, dtype=torch.long, device=self.device), torch.cat(parts)

    def _context_logits(self, out: torch.Tensor, cp: ContextStep) -> torch.Tensor:
        """The rows that need logits live on the context ranks that computed them: gather them in
        plan order; only context rank 0 (where the sampler is) runs the LM head."""
        comm = self.groups.context
        hidden = out.index_select(0, cp.logit_rows)
        if sum(cp.counts):
            hidden = comm.all_gather(hidden, dim=0, sizes=cp.counts).index_select(0, cp.order)
        return self.model.compute_logits(hidden) if comm.rank == 0 else hidden[:0]


def _tensors(obj, depth: int = 0):
    """The tensors a module attribute holds: itself, a block-quantized weight's bytes, or those in
    a (short) container of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(getattr(obj, "data", None), torch.Tensor):
        yield obj.data
    elif isinstance(obj, dict | list | tuple) and depth < 3:
        for x in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors(x, depth + 1)
