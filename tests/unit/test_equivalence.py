"""Every architecture, every scheduling path: greedy tokens identical to transformers', logits
within 1e-4 at prefill and every decode step."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_util import record_logits
from tiny_models import COMMON, GEMMA2, GEMMA3, make_tiny_config
from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

from shardserve.config import EngineConfig
from shardserve.sampling_params import SamplingParams
from shardserve.scheduler.engine_core import EngineCore
from shardserve.scheduler.startup import startup_summary

ARCHS = ["llama", "llama_tied", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3",
         "phi3", "gemma3", "gemma2"]
NEW_TOKENS = 32


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(vocab, (n,), generator=g).tolist() for n in (1, 7, 23, 40)]


def hf_reference(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False)
        tokens = out[0, len(prompt):].tolist()
        logits = model(out[:, :-1]).logits[0, len(prompt) - 1:]
    return tokens, logits


def run_engine(path: str, batch: list[list[int]], **cfg) -> tuple[list[list[int]], list[torch.Tensor], EngineCore]:
    core = EngineCore(EngineConfig(model=path, show_progress=False, **cfg))
    seen = record_logits(core)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    reqs = [core.add_request(str(i), p, greedy) for i, p in enumerate(batch)]
    while core.has_unfinished():
        core.step()
    return [r.output_token_ids for r in reqs], [torch.stack(seen[r.request_id]) for r in reqs], core


def check(tiny_model, arch: str, **cfg) -> EngineCore:
    path, model = tiny_model(arch)
    batch = prompts(model.config.vocab_size)
    tokens, logits, core = run_engine(path, batch, **cfg)
    for p, toks, lg in zip(batch, tokens, logits):
        ref_tokens, ref_logits = hf_reference(model, p)
        assert toks == ref_tokens
        # A preempted request recomputes its KV, so its logits are produced by a new prefill.
        assert lg.shape == ref_logits.shape
        torch.testing.assert_close(lg, ref_logits, atol=1e-4, rtol=1e-4)
    return core


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers(tiny_model, arch):
    check(tiny_model, arch)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "deepseek_v3"])
def test_torch_attention_backend(tiny_model, arch):
    """The gather + SDPA decode path (the one CUDA and half precision use) on the CPU too."""
    core = check(tiny_model, arch, attention_backend="torch")
    assert core.runner.attention.name == "torch"


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_phi3_longrope_both_factor_sets(tiny_model, backend):
    """Phi-3.5 / Phi-4-mini's rotary: 3/4 of each head, LongRoPE past 64 pretrained positions.
    Served past them (the default, 512), every token gets the long factors, as transformers
    gives prompts longer than 64; with --max-model-len 64, the short ones, as it gives shorter."""
    path, model = tiny_model("phi3_longrope")
    g = torch.Generator().manual_seed(3)
    long = [torch.randint(model.config.vocab_size, (n,), generator=g).tolist() for n in (65, 90)]
    short = [torch.randint(model.config.vocab_size, (n,), generator=g).tolist() for n in (1, 13, 30)]
    for batch, cfg in ((long, {}), (short, {"max_model_len": 64})):
        tokens, logits, core = run_engine(path, batch, attention_backend=backend, **cfg)
        assert core.runner.model_cfg.rope_scaling.use_long == (cfg == {})
        assert core.runner.model.rotary.cos.shape[0] == cfg.get("max_model_len", 512)  # the served positions
        said = "LongRoPE long factors (the context exceeds the 64 pretrained tokens; --max-model-len 64 gives" \
            if cfg == {} else "LongRoPE short factors (the context is within the 64 pretrained tokens)"
        assert said in startup_summary(core)
        for p, toks, lg in zip(batch, tokens, logits):
            ref_tokens, ref_logits = hf_reference(model, p)
            assert toks == ref_tokens
            torch.testing.assert_close(lg, ref_logits, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A 16-token sliding window (prompts reach 40 + 32): on every layer of Mistral and Phi-3; on
    Gemma 2's and 3's first layer of two (Gemma 3's with its own RoPE base) and on Qwen2's second
    (max_window_layers 1)."""
    out = {}
    for name, cfg in (("mistral", MistralConfig(intermediate_size=96, sliding_window=16, **COMMON)),
                      ("phi3", Phi3Config(intermediate_size=96, sliding_window=16, **COMMON)),
                      ("gemma3", Gemma3TextConfig(**copy.deepcopy(GEMMA3) | COMMON)),
                      ("gemma2", Gemma2Config(**GEMMA2 | COMMON)),
                      ("qwen2", Qwen2Config(intermediate_size=96, use_sliding_window=True, sliding_window=16,
                                            max_window_layers=1, **COMMON))):
        path = str(tmp_path_factory.mktemp(name))
        out[name] = (path, make_tiny_config(cfg, path))
    return out


@pytest.mark.parametrize("arch,cfg", [
    ("mistral", {}),  # the C kernel: decodes (in the C decode loop) and prefill tokens by block table
    ("phi3", {}),
    ("mistral", {"batch_invariant": False}),  # prefill chunks by SDPA with a window mask
    ("mistral", {"attention_backend": "torch"}),  # decodes by padded groups, masked
    ("mistral", {"max_num_batched_tokens": 7}),  # chunks over cached context, the window inside pages
    ("mistral", {"max_num_batched_tokens": 7, "attention_backend": "torch", "page_size": 4}),
    # Windowed and full layers in one model: each step described once for each.
    ("gemma3", {}),
    ("gemma3", {"batch_invariant": False}),
    ("gemma3", {"attention_backend": "torch"}),
    ("gemma3", {"max_num_batched_tokens": 7, "page_size": 4}),
    ("qwen2", {}),
    # Gemma 2's capped scores: the C kernel, and written out where SDPA has no cap (prefill chunks
    # with --no-batch-invariant, the torch backend's decode groups and chunks over cached context).
    ("gemma2", {}),
    ("gemma2", {"batch_invariant": False}),
    ("gemma2", {"attention_backend": "torch"}),
    ("gemma2", {"max_num_batched_tokens": 7, "attention_backend": "torch", "page_size": 4}),
    ("qwen2", {"max_num_batched_tokens": 7, "attention_backend": "torch", "page_size": 4}),
])
def test_sliding_window_attention(windowed, monkeypatch, arch, cfg):
    """Each token attends to its last 16 keys on a windowed layer, to all on the others, as
    transformers' masks say; a second pass over the same prompts (their prefixes from the cache)
    gives the same tokens."""
    from shardserve.layers import decode_loop

    path, model = windowed[arch]
    loops, run = [], decode_loop.DecodeLoop.run
    monkeypatch.setattr(decode_loop.DecodeLoop, "run", lambda self, x, ctx: loops.append(1) or run(self, x, ctx))
    batch = prompts(model.config.vocab_size)
    tokens, logits, core = run_engine(path, batch, **cfg)
    assert core.runner.window == 16 and core.max_model_len == 512
    assert core.runner.split_window == (arch in ("gemma2", "gemma3", "qwen2"))
    where = "1 of 2 layers (the others attend fully)" if core.runner.split_window else "every layer"
    assert f"; sliding window of 16 tokens on {where}" in startup_summary(core)
    assert bool(loops) == (cfg.get("attention_backend") != "torch")  # decodes in the C layer loop
    for p, toks, lg in zip(batch, tokens, logits):
        ref_tokens, ref_logits = hf_reference(model, p)
        assert toks == ref_tokens
        torch.testing.assert_close(lg, ref_logits, atol=1e-4, rtol=1e-4)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    again = [core.add_request(f"again{i}", p, greedy) for i, p in enumerate(batch)]
    while core.has_unfinished():
        core.step()
    assert [r.output_token_ids for r in again] == tokens and sum(r.num_cached_tokens for r in again) > 0


def test_window_metadata_names_only_the_windows_keys():
    """Contexts of 40 and 30 tokens, a 16-token window, pages of 4: the paged rows start at the
    window's first page (6 and 3) with 0 and 2 keys skipped on it; the torch backend's decode group
    gathers 16 slots a row, the window's own (pages are numbered 100 + i)."""
    from shardserve.attention.metadata import build_metadata

    pages, cpu = [100 + i for i in range(10)], torch.device("cpu")
    decodes = [(pages, 40), (pages, 30)]
    paged = build_metadata(4, decodes, [], cpu, paged_decode=True, window=16).paged
    assert paged.block_tables[:, 0].tolist() == [106, 103] and paged.skips.tolist() == [0, 2]
    assert paged.context_lens.tolist() == [16, 18]
    (group,) = build_metadata(4, decodes, [], cpu, window=16).decode_groups
    want = [[(100 + p // 4) * 4 + p % 4 for p in range(n - 16, n)] for n in (40, 30)]
    assert group.slots.tolist() == want and group.mask is None


def test_linear_rope_scaling(tiny_model, tmp_path):
    """Linear scaling (position interpolation: every frequency divided by the factor)."""
    path = str(tmp_path / "linear")
    model = make_tiny_config(LlamaConfig(intermediate_size=96, rope_scaling={"rope_type": "linear", "factor": 3.0},
                                         **COMMON), path)
    batch = prompts(model.config.vocab_size)[2:]
    tokens, logits, core = run_engine(path, batch)
    assert core.runner.model_cfg.rope_scaling.kind == "linear"
    for p, toks, lg in zip(batch, tokens, logits):
        ref_tokens, ref_logits = hf_reference(model, p)
        assert toks == ref_tokens
        torch.testing.assert_close(lg, ref_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v2"])
def test_chunked_prefill(tiny_model, arch):
    core = check(tiny_model, arch, max_num_batched_tokens=7)
    assert core.allocator.num_used == 0 or core.cfg.enable_prefix_cache


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe", "deepseek_v3"])
def test_preemption_with_tiny_pool(tiny_model, arch):
    # 4 requests of up to 72 tokens, 4-token pages: 18 pages fit one request, not all four.
    core = check(tiny_model, arch, page_size=4, num_pages=24)
    assert core.scheduler.num_preemptions > 0


def test_prefix_cache_hits_match(tiny_model):
    path, model = tiny_model("qwen3")
    shared = prompts(model.config.vocab_size)[3]  # 40 tokens
    batch = [shared + [5, 6, 7], shared[:33] + [9]]
    core = EngineCore(EngineConfig(model=path, show_progress=False, page_size=8))
    first = core.add_request("a", shared, SamplingParams(max_tokens=4, temperature=0))
    while core.has_unfinished():
        core.step()
    assert first.num_cached_tokens == 0
    reqs = [core.add_request(str(i), p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
            for i, p in enumerate(batch)]
    while core.has_unfinished():
        core.step()
    assert [r.num_cached_tokens for r in reqs] == [40, 32]
    for p, r in zip(batch, reqs):
        assert r.output_token_ids == hf_reference(model, p)[0]
    assert core.allocator.hit_rate > 0


def test_no_prefix_cache_flag(tiny_model):
    path, model = tiny_model("llama")
    core = EngineCore(EngineConfig(model=path, show_progress=False, page_size=8, enable_prefix_cache=False))
    p = prompts(model.config.vocab_size)[3]
    for rid in ("a", "b"):
        r = core.add_request(rid, p, SamplingParams(max_tokens=2, temperature=0))
        while core.has_unfinished():
            core.step()
        assert r.num_cached_tokens == 0


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_latent_prefill_decompressed(tiny_model, arch, monkeypatch):
    """SDPA prefill (not batch-invariant) decompresses K/V from the latents: whole chunks, later
    chunks over cached context (7-token budget), still equal to transformers."""
    from shardserve.layers.latent_attention import LatentAttention

    calls = []
    prefill = LatentAttention._prefill
    monkeypatch.setattr(LatentAttention, "_prefill", lambda self, *a: calls.append(a[-1].kv_slots is None)
                        or prefill(self, *a))
    check(tiny_model, arch, batch_invariant=False, max_num_batched_tokens=7)
    assert True in calls and False in calls  # chunks alone and chunks over earlier context
