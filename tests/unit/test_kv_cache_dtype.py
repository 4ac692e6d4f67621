"""--kv-cache-dtype: the KV pool's dtype decided once per runner (engine/model_runner.kv_cache_dtype).

auto keeps the compute dtype but for --dtype bfloat16 on a CPU whose kernels take bfloat16
activations and read a bfloat16 cache; bfloat16 asks for that cache on the CPU for any checkpoint
(the default Q4_1 GGUF here: half the bytes a decode step's attention reads); float32 keeps
float32. What cannot be had is refused in one line naming the flag, before any weight loads.
On the default model with a bfloat16 cache a request gives the same tokens and logprobs alone, in
a batch, and after a cached prefix, and its greedy tokens stay close to the float32 cache's."""

from __future__ import annotations

import pytest
import torch

from shardserve.attention import cpu_kernel
from shardserve.cli.main import build_parser
from shardserve.config import EngineConfig
from shardserve.engine import model_runner
from shardserve.launch import devices
from shardserve.llm import LLM
from shardserve.sampling_params import SamplingParams
from shardserve.scheduler.engine_core import EngineCore

HAS_BF16_CACHE = cpu_kernel.bf16_cache((64, 64))
GREEDY = SamplingParams(max_tokens=16, temperature=0, logprobs=2)


def test_the_flag_reaches_the_config_and_bad_values_are_refused() -> None:
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "bfloat16"])
    from shardserve.cli.flags import engine_config

    assert engine_config(args).kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8")


def test_what_the_api_process_counts() -> None:
    assert devices.kv_value_bytes(EngineConfig(model="m", kv_cache_dtype="bfloat16")) == 2
    assert devices.kv_value_bytes(EngineConfig(model="m", dtype="bfloat16", kv_cache_dtype="float32")) == 4


def test_refusals_name_the_flag_before_loading(tiny_model, monkeypatch) -> None:
    path, _ = tiny_model("llama")  # heads of 16: no bfloat16 cache for them
    loaded = []
    monkeypatch.setattr(model_runner, "load_weights", lambda *a, **k: loaded.append(1))
    with pytest.raises(ValueError, match=r"--kv-cache-dtype bfloat16 needs .* heads 16/16"):
        EngineCore(EngineConfig(model=path, num_pages=16, kv_cache_dtype="bfloat16", show_progress=False))
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16 needs .* backend torch"):
        EngineCore(EngineConfig(model=path, num_pages=16, kv_cache_dtype="bfloat16", attention_backend="torch",
                                show_progress=False))
    with pytest.raises(ValueError, match="--kv-cache-dtype float32 needs float32 compute, got float16"):
        EngineCore(EngineConfig(model=path, num_pages=16, dtype="float16", kv_cache_dtype="float32",
                                show_progress=False))
    assert loaded == []


@pytest.mark.skipif(not HAS_BF16_CACHE, reason="a bfloat16 KV cache needs AVX512-BF16")
def test_float32_is_kept_where_asked(tiny_model) -> None:
    path, _ = tiny_model("llama_hd32")
    core = EngineCore(EngineConfig(model=path, num_pages=16, dtype="bfloat16", kv_cache_dtype="float32",
                                   show_progress=False))
    assert core.runner.pool.k.dtype == torch.float32
    core = EngineCore(EngineConfig(model=path, num_pages=16, kv_cache_dtype="bfloat16", show_progress=False))
    assert core.runner.pool.k.dtype == torch.bfloat16 and core.runner.dtype == torch.float32


@pytest.mark.skipif(not HAS_BF16_CACHE, reason="a bfloat16 KV cache needs AVX512-BF16")
def test_the_default_model_on_a_bfloat16_cache(smollm2_path: str) -> None:
    from test_batch_invariance import TARGET, prompts

    with LLM(model=smollm2_path, show_progress=False, enable_prefix_cache=False) as llm:
        exact = llm.generate([TARGET], GREEDY, use_tqdm=False)[0]
    with LLM(model=smollm2_path, show_progress=False, enable_prefix_cache=False, kv_cache_dtype="bfloat16") as llm:
        runner = llm.engine.runner
        assert runner.pool.k.dtype == torch.bfloat16 and runner.pool.k.element_size() == 2
        alone = llm.generate([TARGET], GREEDY, use_tqdm=False)[0]
        others = prompts(12, seed=13)
        batch = llm.generate(others[:6] + [TARGET] + others[6:], GREEDY, use_tqdm=False)[6]
        shared = prompts(1, seed=12, lo=100, hi=101)[0]
        whole = llm.generate([shared + [601, 602]], GREEDY, use_tqdm=False)[0]
    assert (batch.token_ids, batch.logprobs) == (alone.token_ids, alone.logprobs)
    # The cache's rounding moves logprobs by far less than a token's margin here.
    assert alone.token_ids[:8] == exact.token_ids[:8]
    first = [step["logprob"] for step in alone.logprobs[:8]]
    want = [step["logprob"] for step in exact.logprobs[:8]]
    assert max(abs(a - b) for a, b in zip(first, want)) < 0.05
    with LLM(model=smollm2_path, show_progress=False, kv_cache_dtype="bfloat16") as llm:
        llm.generate([shared + [501, 502, 503]], GREEDY, use_tqdm=False)
        warm = llm.generate([shared + [601, 602]], GREEDY, use_tqdm=False)[0]
    assert warm.num_cached_tokens >= 96
    assert (warm.token_ids, warm.logprobs) == (whole.token_ids, whole.logprobs)


@pytest.mark.skipif(not HAS_BF16_CACHE, reason="a bfloat16 KV cache needs AVX512-BF16")
def test_a_draft_keeps_its_own_cache(tiny_model) -> None:
    """--kv-cache-dtype is the target's: a draft whose heads take no bfloat16 cache (16 wide)
    keeps its float32 one instead of refusing the server."""
    target, _ = tiny_model("llama_hd32")
    draft, _ = tiny_model("llama")
    spec = {"model": draft, "num_speculative_tokens": 2}
    with LLM(target, show_progress=False, num_pages=64, kv_cache_dtype="bfloat16", speculative_config=spec) as llm:
        out = llm.generate([[5, 17, 42]], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
        engine = llm.engine
        assert engine.runner.pool.k.dtype == torch.bfloat16
        assert engine.spec.proposer.runner.pool.k.dtype == torch.float32
    assert len(out.token_ids) == 8


def test_the_draft_pool_is_counted_in_its_own_dtype(tiny_model, monkeypatch) -> None:
    """A bfloat16 target cache halves the target's pool, not the draft's: it keeps float32."""
    import io

    from shardserve.distributed.layout import LayoutError
    from shardserve.launch import spec_checks
    from shardserve.loader.model_path import resolve_checkpoint
    from shardserve.loader.weights import read_model_config

    target, draft = resolve_checkpoint(tiny_model("llama_hd32")[0]), resolve_checkpoint(tiny_model("llama")[0])
    tcfg, dcfg = read_model_config(target), read_model_config(draft)
    monkeypatch.setattr(spec_checks, "checkpoint_bytes", lambda ckpt: 0)
    pages = 1000
    per_token = dcfg.kv_values_per_token(dcfg.num_kv_heads, dcfg.num_layers)
    draft_pool = pages * 16 * per_token * 4  # float32
    target_pool = pages * 16 * tcfg.kv_values_per_token(tcfg.num_kv_heads, tcfg.num_layers) * 2
    for avail, fits in ((target_pool + draft_pool + 4096, True), (target_pool + draft_pool // 2 + 4096, False)):
        monkeypatch.setattr(spec_checks, "open", lambda *a, avail=avail: io.StringIO(
            f"MemAvailable: {avail // 1024} kB\n"), raising=False)
        cfg = EngineConfig(model="m", num_pages=pages, kv_cache_dtype="bfloat16")
        if fits:
            spec_checks.check_draft_fits(cfg, target, draft, tcfg, dcfg)
        else:
            with pytest.raises(LayoutError, match="KV pool"):
                spec_checks.check_draft_fits(cfg, target, draft, tcfg, dcfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_cache_write_stores_what_index_copy_stores(dtype: torch.dtype) -> None:
    """attention/backend.write_cache takes the C write on the CPU: the same bits as torch's
    `index_copy_` of the rounded rows (nearest even; NaN, infinities, ties), from strided rows of
    a fused q/k/v output, on a prefill's many rows; a slot outside the cache writes nothing."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(300, 5, 64, generator=g) * 3
    qkv[0, 3, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    qkv[1, 3, :3] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8)])  # ties to even, both ways
    k = qkv[:, 3:]  # [300, 2, 64], rows 320 floats apart
    slots = torch.randperm(1000, generator=g)[:300]
    want = torch.full((1000, 2, 64), 7.0, dtype=dtype)
    want.index_copy_(0, slots, k.to(dtype))
    got = torch.full((1000, 2, 64), 7.0, dtype=dtype)
    assert cpu_kernel.write_rows(k, got, slots)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and int(nan.sum()) == 1  # a NaN's payload bits are not compared
    assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])
    before = got.clone()
    with pytest.raises(IndexError, match="outside the cache's 1000 rows"):
        cpu_kernel.write_rows(k[:2], got, torch.tensor([5, 1000]))
    assert torch.equal(got.view(bits), before.view(bits))
    assert not cpu_kernel.write_rows(k.to(torch.float64), got, slots)  # not its case: the caller's torch path
