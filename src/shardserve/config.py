"""Frozen configuration objects: the model's shape, the engine's knobs, and parallel state.

Everything here is plain data. Nothing reads a global. Where a rank sits in the grid is not
configuration: it is `distributed.layout.Layout` plus the rank, carried by `ParallelGroups` and
handed to the constructors that need it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# The model's shape lives in model_config.py; its names are kept importable from here.
from shardserve.model_config import ModelConfig, eos_token_ids  # noqa: F401
from shardserve.rope_config import RopeScaling  # noqa: F401

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")  # names; `torch_dtype` maps them (torch imported only then)
# "auto" is resolved to one of DTYPES by each process that computes (loader/weights.resolve_dtype).
DTYPE_CHOICES = ("auto", *DTYPES)
# Sizes known without importing torch. "auto" counts as float32, an upper bound (it is float32 on
# the CPU, the checkpoint's own on a GPU): the API process checks a deployment before any rank
# has resolved it (resolving needs torch, which that process never loads).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 4}


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


# The KV cache's dtype (engine/model_runner.kv_cache_dtype decides): "auto" = the compute dtype,
# but bfloat16 under --dtype bfloat16 on the CPU where the products take bfloat16 activations and
# the CPU attention kernel reads such a cache; "bfloat16" asks for one (a float32 checkpoint or a
# GGUF on the CPU: half the bytes a decode step's attention reads, as llama.cpp's 16-bit cache);
# "float32" keeps float32 (float32 compute only).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")

# Where the scheduler ranks run (--distributed-executor-backend): "local" = this machine's child
# processes (other machines' through their own launchers, --nnodes), "ray" = Ray actors on a Ray
# cluster's nodes (launch/ray_cluster.py).
EXECUTORS = ("local", "ray")

# Attention backends (attention/select.py chooses): "cpu" = the C kernel reading pages in place
# (CPU, float32), "triton" = paged Triton kernels (GPU, or the CPU under Triton's interpreter),
# "torch" = page gather + SDPA (any device and dtype), "auto" = cpu on the CPU where it applies,
# triton on a GPU where Triton imports, else torch.
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
# "null": an ordinary server. "prefill": computes prompts for decode instances and ships their
# KV; "decode": takes requests (through `shardserve router --prefill .. --decode ..`), has a
# prefill instance compute each prompt, and generates the rest.
DISAGGREGATION_MODES = ("null", "prefill", "decode")
# Weights: "auto" keeps a GGUF's block formats (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) and multiplies
# them by the CPU kernel (floats for other checkpoints); "none" expands everything to `dtype`;
# "int8" quantizes a float checkpoint's linear weights to Q8_0 blocks at load (weight-only int8
# with one scale per 32 weights: finer than one per channel, and the same kernel).
QUANTIZATION_MODES = ("auto", "none", "int8")
# Speculative decoding: "ngram" looks proposals up in the request's own tokens (vLLM's prompt
# lookup); "draft" has a smaller model of the same vocabulary propose them.
SPECULATIVE_METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16  # proposals per step: past this, a rejection early wastes most of the verify
DRAFT_TP = ("1", "same")  # the draft whole on the leader, or sharded like the target


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (see scheduler/speculator.py). `num_speculative_tokens` K proposals a
    step per decoding request; `ngram_min`..`ngram_max`: the suffix lengths looked up (longest
    first); `model`: the draft checkpoint, placed by `draft_tp`; with more than
    `disable_by_batch_size` requests in a step nothing is proposed (verification costs compute a
    big batch no longer has spare)."""

    method: str
    num_speculative_tokens: int
    ngram_min: int = 2
    ngram_max: int = 4
    model: str | None = None
    draft_tp: str = "1"
    disable_by_batch_size: int | None = 4

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        """From `LLM(speculative_config={...})`: these fields, or vLLM's names for them."""
        aliases = {"prompt_lookup_min": "ngram_min", "prompt_lookup_max": "ngram_max",
                   "draft_tensor_parallel_size": "draft_tp", "speculative_disable_by_batch_size":
                   "disable_by_batch_size"}
        fields = {aliases.get(k, k): v for k, v in d.items()}
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {sorted(unknown)} (known: "
                             f"{sorted(cls.__dataclass_fields__)})")
        if "method" not in fields:
            fields["method"] = "draft" if fields.get("model") else "ngram"
        if fields.get("draft_tp") is not None:
            fields["draft_tp"] = str(fields["draft_tp"])
        return cls(**fields)

    def __post_init__(self) -> None:
        k, bound = self.num_speculative_tokens, MAX_SPECULATIVE_TOKENS
        checks = [
            (self.method in SPECULATIVE_METHODS, "speculative-method", f"must be one of {list(SPECULATIVE_METHODS)}"),
            (isinstance(k, int) and 1 <= k <= bound, "num-speculative-tokens", f"must be an integer in [1, {bound}]"),
            (isinstance(self.ngram_min, int) and self.ngram_min >= 1, "ngram-min", "must be an integer >= 1"),
            (isinstance(self.ngram_max, int) and self.ngram_max >= self.ngram_min, "ngram-max",
             f"must be an integer >= --ngram-min ({self.ngram_min})"),
            ((self.method == "draft") == bool(self.model), "speculative-model",
             "is needed by --speculative-method draft and only by it"),
            (self.draft_tp in DRAFT_TP, "speculative-draft-tp", f"must be one of {list(DRAFT_TP)}"),
            (self.method == "draft" or self.draft_tp == "1", "speculative-draft-tp",
             "places a draft model: it needs --speculative-method draft"),
            (self.method == "ngram" or all(getattr(self, f) == self.__dataclass_fields__[f].default
                                           for f in ("ngram_min", "ngram_max")), "ngram-min",
             "and --ngram-max are for --speculative-method ngram"),
            (self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
             "speculative-disable-by-batch-size", "must be >= 1"),
        ]
        attr = {"speculative-method": "method", "num-speculative-tokens": "num_speculative_tokens",
                "speculative-model": "model", "speculative-draft-tp": "draft_tp",
                "speculative-disable-by-batch-size": "disable_by_batch_size"}
        for ok, flag, why in checks:
            if not ok:
                got = getattr(self, attr.get(flag, flag.replace("-", "_")))
                raise ValueError(f"--{flag} {why} (got {got!r})")


SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy


@dataclass(frozen=True)
class EngineConfig:
    """The knobs of one engine instance (one rank). Defaults suit a CPU run of a small model."""

    model: str | None = None
    dtype: str = "auto"  # see DTYPE_CHOICES
    device: str | None = None
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory: float = 0.25
    max_num_batched_tokens: int = 2048
    max_running_requests: int = 256
    # "fcfs": by arrival; "priority": by each request's SamplingParams.priority, then arrival.
    scheduling_policy: str = "fcfs"
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    seed: int = 0
    show_progress: bool = True
    # CPU threads of each scheduler rank (torch and the C kernels' OpenMP); None: this machine's
    # cores shared out among its ranks, or torch's own choice for a single rank.
    threads: int | None = None
    dist_timeout: float = 60.0  # seconds before a collective that never completes is an error
    attention_backend: str = "auto"  # see ATTENTION_BACKENDS
    kv_cache_dtype: str = "auto"  # see KV_CACHE_DTYPES
    # Prefill tokens attend by the CPU decode kernel, so a token's attention is the same whether it
    # is prefilled (whole, chunked, after a cached prefix) or decoded: with the products' one
    # arithmetic at every batch size, greedy results do not depend on the batch or the cache.
    # None: wherever that kernel runs; True: required (refused where it cannot run); False: prefill
    # by SDPA (faster for long prompts; the README has the cost).
    batch_invariant: bool | None = None
    quantization: str = "auto"  # see QUANTIZATION_MODES
    # Pipeline parallelism (the stage count is the layout's pp): layers per stage (None: even
    # split) and how many micro-batches may be in flight (None: one per stage).
    pp_layer_partition: tuple[int, ...] | None = None
    pp_micro_batches: int | None = None
    # Expert parallelism's hot-expert replicas (EPLB): extra expert slots, placed from routing
    # counts recorded by `shardserve record-experts` (a JSON file).
    ep_num_redundant_experts: int = 0
    ep_expert_placement: str | None = None
    # Disaggregated prefill/decode (see DISAGGREGATION_MODES): where this instance's KV channels
    # listen (a prefill leader's bootstrap port; a decode instance's ranks, port + tensor rank),
    # and how long a peer may stay silent about a request before it is dropped.
    disaggregation_mode: str = "null"
    disaggregation_host: str = "127.0.0.1"
    disaggregation_port: int = 0
    disaggregation_timeout: float = 30.0
    # Speculative decoding (a SpeculativeConfig, or its fields as a dict as vLLM takes it); None: off.
    speculative_config: SpeculativeConfig | None = None
    # Multi-LoRA (vLLM's names): adapters in `max_loras` slots at once, each of rank up to
    # `max_lora_rank`; `max_cpu_loras` (None: max_loras) kept parsed in host memory, least
    # recently used dropped first; fully sharded: A and B both split over the tensor group.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    fully_sharded_loras: bool = False
    # vLLM's --async-scheduling (SGLang's overlap schedule): the leader plans step n+1 while step n
    # runs on an executor thread, the tokens step n is still sampling left as placeholders that
    # the sampling rank fills in (scheduler/overlap.py). One pipeline stage, no context ranks, for now.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        checks = [
            (self.dtype in DTYPE_CHOICES, "dtype", f"must be one of {sorted(DTYPE_CHOICES)}"),
            (self.page_size >= 1, "page_size", "must be >= 1"),
            (self.num_pages is None or self.num_pages >= 1, "num_pages", "must be >= 1"),
            (self.threads is None or self.threads >= 1, "threads", "must be >= 1"),
            (self.kv_cache_memory > 0, "kv_cache_memory", "must be > 0"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1"),
            (self.max_running_requests >= 1, "max_running_requests", "must be >= 1"),
            (self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
             f"must be one of {list(SCHEDULING_POLICIES)}"),
            (self.scheduling_policy == "fcfs" or self.disaggregation_mode == "null", "scheduling_policy",
             "'priority' is not implemented with --disaggregation-mode (a decode instance takes its transfers in "
             "arrival order)"),
            (self.pp_micro_batches is None or self.pp_micro_batches >= 1, "pp_micro_batches", "must be >= 1"),
            (self.ep_num_redundant_experts >= 0, "ep_num_redundant_experts", "must be >= 0"),
            (self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
             f"must be one of {list(ATTENTION_BACKENDS)}"),
            (self.quantization in QUANTIZATION_MODES, "quantization", f"must be one of {list(QUANTIZATION_MODES)}"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"must be one of {list(KV_CACHE_DTYPES)}"),
            (self.disaggregation_mode in DISAGGREGATION_MODES, "disaggregation_mode",
             f"must be one of {list(DISAGGREGATION_MODES)}"),
            (self.disaggregation_timeout > 0, "disaggregation_timeout", "must be > 0"),
            (self.max_loras >= 1, "max_loras", "must be >= 1"),
            (self.max_lora_rank >= 1, "max_lora_rank", "must be >= 1"),
            (self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras, "max_cpu_loras",
             f"must be >= max_loras ({self.max_loras})"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"{name} {why} (got {getattr(self, name)!r})")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            raise ValueError("dtype 'auto' is resolved against the checkpoint first (loader/weights.resolve_dtype)")
        return torch_dtype(self.dtype)
