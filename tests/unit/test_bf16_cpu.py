"""--dtype bfloat16 on the CPU: the weights as bfloat16 rows for the C kernels (quant_kernel.
bf16_weights), float32 around them (activations, norms), the C decode loop running it; a
bfloat16 KV cache where the products take bfloat16 activations and the attention kernel reads
one (heads of 32 here: model_runner.kv_cache_dtype), float32 otherwise.

The oracle is transformers in float32 holding the same bfloat16 weights, each linear layer's
input rounded to bfloat16 where AMX tiles or vdpbf16ps run the products (they take bfloat16
activations; quant_kernel.bf16_path). With float32 activations: the same greedy tokens and
logits within 1e-4, as for float32. With bfloat16 activations: every step's logits within
bfloat16's 1e-2 of the reference's on the same tokens, each token its argmax but at a near tie
(a top-two margin within that tolerance). Where the products take bfloat16 activations, the
float32-activation path is checked too (SHARDSERVE_FLOAT32_ACTIVATIONS=1 in a child process),
and on AMX hosts the vdpbf16ps path (SHARDSERVE_NO_AMX=1). A request alone and
in a batch gives the same tokens and logprobs, bit for bit, on the default model's weights in
bfloat16.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from shardserve.attention import cpu_kernel
from shardserve.config import EngineConfig
from shardserve.layers import quant_kernel
from shardserve.layers.linear import PackedLinear
from shardserve.llm import LLM
from shardserve.sampling_params import SamplingParams
from shardserve.scheduler.engine_core import EngineCore

pytestmark = pytest.mark.skipif(quant_kernel.available() is not None, reason="the C kernels do not build here")

# Float32 activations: the float32 product of the same weights, so float32's tolerance. bfloat16
# activations: an input that float rounding moves across a bfloat16 rounding boundary changes by
# one bfloat16 step (2^-8 of it), whichever side is "right", so the tolerance is bfloat16's (of
# the logits' scale where they exceed 1).
TOLERANCE = {False: 1e-4, True: 1e-2}

# Matrices the engine keeps as loaded (float32 here) under bfloat16: DeepSeek's gate (layers/
# moe_gate.py) and the latent attention's up-projection, which runs in torch as two per-head
# products (layers/latent_attention.py), not in the C kernels.
KEPT_FLOAT32 = ("mlp.gate.weight", "kv_b_proj.weight")


def bf16_reference(model: nn.Module, arch: str, amx: bool) -> nn.Module:
    """transformers' model with the engine's bfloat16 weights, and where `amx` (bfloat16
    activations: AMX tiles or vdpbf16ps) its linear layers' inputs rounded to bfloat16 as the
    products take them."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() >= 2 and not (arch.startswith("deepseek") and name.endswith(KEPT_FLOAT32)):
                p.copy_(p.bfloat16().float())
    if amx:
        for m in ref.modules():
            if isinstance(m, nn.Linear):
                m.register_forward_pre_hook(lambda mod, args: (args[0].bfloat16().float(), *args[1:]))
    return ref


def check_against_transformers(tiny_model, arch: str, amx: bool) -> EngineCore:
    """Every step's logits against the reference's on the engine's own tokens (teacher-forced, so
    a step past a near tie is still compared); each greedy token the reference's argmax, but
    where its top two are within the tolerance and the activations are bfloat16."""
    from test_equivalence import hf_reference, prompts, run_engine

    path, model = tiny_model(arch)
    ref = bf16_reference(model, arch, amx)
    batch = prompts(model.config.vocab_size)
    tokens, logits, core = run_engine(path, batch, dtype="bfloat16")
    tol = TOLERANCE[amx]
    for p, toks, lg in zip(batch, tokens, logits):
        with torch.no_grad():
            forced = ref(torch.tensor([p + toks[:-1]])).logits[0, len(p) - 1:]
        scale = max(1.0, float(forced.abs().max()))
        torch.testing.assert_close(lg, forced, atol=tol * scale, rtol=tol)
        for step, token in enumerate(toks):
            top = forced[step].topk(2)
            if token != int(top.indices[0]):
                assert amx and float(top.values[0] - top.values[1]) <= 2 * tol * scale, (step, toks)
        if not amx:
            assert toks == hf_reference(ref, p)[0]  # and so transformers' own greedy generation
    return core


# DeepSeek-V3 with bfloat16 activations is left to the float32-activation check: its sigmoid
# gate's near ties let one bfloat16 step pick another expert, and the logits then part by far
# more than a rounding (the tokens held in the runs tried).
BF16_ARCHS = ["llama", "llama_tied", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "llama_hd32", "qwen3_hd32"]


@pytest.mark.parametrize("arch", BF16_ARCHS)
def test_matches_transformers_on_the_same_bfloat16_weights(tiny_model, arch: str) -> None:
    amx = quant_kernel.bf16_activations()
    if amx and arch == "deepseek_v3":
        pytest.skip("checked with float32 activations (test_the_other_bf16_paths)")
    core = check_against_transformers(tiny_model, arch, amx)
    runner = core.runner
    # heads of 32 take a bfloat16 KV cache where the attention kernel reads one (AVX512-BF16)
    kv = torch.bfloat16 if arch.endswith("hd32") and runner_takes_bf16_cache() else torch.float32
    assert runner.dtype == torch.float32 and runner.pool.k.dtype == kv and runner.pool.v.dtype == kv
    assert runner.quantization == "bf16" and runner.attention.name == "cpu"
    names = {q.name for m in runner.model.modules() if isinstance(m, PackedLinear) and m.quant for _, q in m.quant}
    assert "BF16x16" in names


def runner_takes_bf16_cache() -> bool:
    """Whether heads of 32 get a bfloat16 KV cache here (model_runner.kv_cache_dtype)."""
    return quant_kernel.bf16_activations() and cpu_kernel.bf16_cache((32, 32))


def generate_bf16(path: str, c_loop: bool) -> tuple[list[int], list[int], EngineCore, list[int]]:
    """Six greedy tokens of one request in bfloat16, the decode steps in the C loop or (c_loop
    False) through the modules; returns them, the decode-loop row counts, the engine, and the
    request's pages."""
    core = EngineCore(EngineConfig(model=path, dtype="bfloat16", num_pages=32, show_progress=False))
    loop = core.runner.model._decode_loop()
    assert loop is not None
    calls = []
    run = loop.run
    loop.run = lambda x, ctx: calls.append(x.shape[0]) or run(x, ctx)
    if not c_loop:
        loop.applies = lambda x, ctx: False
    req = core.add_request("r", [5, 17, 42], SamplingParams(max_tokens=6, temperature=0))
    pages: list[int] = []
    while core.has_unfinished():
        core.step()
        pages = list(req.pages) or pages
    return req.output_token_ids, calls, core, pages


@pytest.mark.parametrize("arch", ["llama", "llama_hd32"])
def test_the_c_decode_loop_runs_bfloat16(tiny_model, arch: str) -> None:
    """Every decode step in the C loop; with a bfloat16 KV cache (heads of 32, AVX512-BF16) the
    loop writes the cache's rows as the modules do (rounded to nearest even), bit for bit."""
    path, _ = tiny_model(arch)
    tokens, calls, core, pages = generate_bf16(path, c_loop=True)
    assert len(tokens) == 6 and calls == [1] * 5  # every decode step in the C loop
    modules_tokens, modules_calls, modules, modules_pages = generate_bf16(path, c_loop=False)
    assert modules_calls == [] and modules_tokens == tokens and modules_pages == pages
    ps = core.runner.pool.page_size
    slots = torch.tensor([p * ps + i for p in pages for i in range(ps)])[: 3 + 5]  # prompt and 5 decoded
    kv = torch.bfloat16 if arch == "llama_hd32" and runner_takes_bf16_cache() else torch.float32
    for ours, theirs in ((core.runner.pool.k, modules.runner.pool.k), (core.runner.pool.v, modules.runner.pool.v)):
        assert ours.dtype == theirs.dtype == kv
        assert torch.equal(ours[:, slots], theirs[:, slots])


SUBPROCESS = """
import sys
sys.path[:0] = {paths!r}
import conftest, pytest
from shardserve.layers import quant_kernel
from test_bf16_cpu import check_against_transformers
assert quant_kernel.bf16_path() == {want!r}, quant_kernel.bf16_path()
import os
def tiny_model(kind):
    path = os.path.join({path!r}, kind)
    return path, conftest.make_tiny(kind, path)
for arch in {archs!r}:
    check_against_transformers(tiny_model, arch, amx=quant_kernel.bf16_activations())
print("checked: ok")
"""

# The paths this CPU can take besides its default: (environment, the path it gives, architectures).
OTHER_PATHS = [({"SHARDSERVE_FLOAT32_ACTIVATIONS": "1"}, "float32 activations", BF16_ARCHS),
               ({"SHARDSERVE_NO_AMX": "1"}, "avx512-bf16", [a for a in BF16_ARCHS if a != "deepseek_v3"])]


@pytest.mark.parametrize("env, want, archs", OTHER_PATHS, ids=["float32-activations", "no-amx"])
def test_the_other_bf16_paths(tmp_path, env: dict[str, str], want: str, archs: list[str]) -> None:
    """SHARDSERVE_FLOAT32_ACTIVATIONS=1 (or a CPU with neither AMX nor AVX512-BF16): bfloat16
    weights against float32 activations, transformers' float32 on the same weights to 1e-4.
    SHARDSERVE_NO_AMX=1 on an AMX host: vdpbf16ps, bfloat16 activations."""
    if quant_kernel.bf16_path() in (want, "float32 activations"):
        pytest.skip(f"bfloat16 products run on {quant_kernel.bf16_path()} here: checked above")
    if want == "avx512-bf16" and quant_kernel.bf16_path() != "amx":
        pytest.skip("no AMX here to turn off")
    tests = os.path.dirname(os.path.dirname(__file__))
    code = SUBPROCESS.format(paths=[tests, os.path.join(tests, "unit")], path=str(tmp_path), archs=archs, want=want)
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "checked: ok" in out.stdout


GREEDY = SamplingParams(max_tokens=16, temperature=0, logprobs=2)


def test_bfloat16_alone_equals_in_a_batch(smollm2_path: str) -> None:
    """The default model's weights expanded to bfloat16 rows (heads of 64: a bfloat16 KV cache
    where the kernels read one): one request alone and among 12 others (prefills and decodes
    around it) gives the same tokens and logprobs, bit for bit; so does a request whose prefix
    came from the prefix cache against the same request computed whole."""
    from test_batch_invariance import TARGET, prompts

    with LLM(model=smollm2_path, dtype="bfloat16", show_progress=False, enable_prefix_cache=False) as llm:
        kv = llm.engine.runner.pool.k.dtype
        assert kv == (torch.bfloat16 if quant_kernel.bf16_activations() and cpu_kernel.bf16_cache((64, 64))
                      else torch.float32)
        alone = llm.generate([TARGET], GREEDY, use_tqdm=False)[0]
        others = prompts(12, seed=13)
        batch = llm.generate(others[:6] + [TARGET] + others[6:], GREEDY, use_tqdm=False)[6]
        shared = prompts(1, seed=12, lo=100, hi=101)[0]
        whole = llm.generate([shared + [601, 602]], GREEDY, use_tqdm=False)[0]
    assert batch.token_ids == alone.token_ids and batch.logprobs == alone.logprobs
    with LLM(model=smollm2_path, dtype="bfloat16", show_progress=False) as llm:
        llm.generate([shared + [501, 502, 503]], GREEDY, use_tqdm=False)
        warm = llm.generate([shared + [601, 602]], GREEDY, use_tqdm=False)[0]
    assert warm.num_cached_tokens >= 96
    assert (warm.token_ids, warm.logprobs) == (whole.token_ids, whole.logprobs)


def bf16_mlp(g: torch.Generator) -> nn.Module:
    """A gated MLP (96 -> 64 -> 96) on random BF16 weights in the kernels' layout, as loading
    leaves one (each product's takes_bf16_input decided)."""
    from shardserve.distributed.communicator import Communicator
    from shardserve.layers.mlp import GatedMLP
    from shardserve.loader.quantized import bf16_rows

    mlp = GatedMLP(96, 64, Communicator(), torch.float32, torch.device("cpu"))
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        w = torch.randn(layer.out_features, layer.weight.shape[1], generator=g)
        layer.quant = ((0, quant_kernel.kernel_layout(bf16_rows(w))),)
        layer.weight, layer._bf16_input = None, quant_kernel.takes_bf16(layer.quant)
    return mlp


def test_silu_hands_the_down_product_the_bits_it_would_round() -> None:
    """cpu_ops.silu_mul(bf16=True) rounds its rows as a BF16 product rounds its activations, and
    such a product (quant_kernel.takes_bf16, the vdpbf16ps path) given them gives the bits it
    gives from the float32 rows: the gated MLP skips a pass, its numbers unchanged."""
    from shardserve.layers import cpu_ops
    from shardserve.loader.quantized import bf16_rows, float_rows

    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(300, 2 * 96, generator=g) * 4
    gate_up[0, :3] = torch.tensor([float("inf"), -float("inf"), 90.0])
    h32 = cpu_ops.silu_mul(gate_up)
    h16 = cpu_ops.silu_mul(gate_up, bf16=True)
    assert h16.dtype == torch.bfloat16 and h16.shape == h32.shape
    finite = h32.isfinite()
    assert torch.equal(h16.isfinite(), finite)
    assert torch.equal(h16.view(torch.int16)[finite], h32.to(torch.bfloat16).view(torch.int16)[finite])
    w = quant_kernel.kernel_layout(bf16_rows(torch.randn(40, 96, generator=g)))
    if not quant_kernel.takes_bf16(((0, w),)):
        pytest.skip(f"BF16 products run on {quant_kernel.bf16_path()} here, which rounds its own activations")
    h = h32.clone()
    h[0] = 1.0  # finite rows: the products' bits are compared
    assert torch.equal(quant_kernel.linear(h.bfloat16(), ((0, w),), 40), quant_kernel.linear(h, ((0, w),), 40))
    with pytest.raises(TypeError, match="take float32 activations"):
        quant_kernel.linear(h.bfloat16(), ((0, quant_kernel.kernel_layout(float_rows(torch.ones(40, 96)))),), 40)

    mlp = bf16_mlp(g)
    assert mlp.down_proj.takes_bf16_input
    x = torch.randn(300, 96, generator=g)
    handed = mlp(x)
    mlp.down_proj._bf16_input = False  # the float32 rows, rounded by the product itself
    assert torch.equal(handed, mlp(x))


@pytest.mark.parametrize("rows, k", [(1, 96), (5, 96), (8, 96), (13, 96), (50, 96), (256, 96), (257, 96), (600, 96),
                                     (300, 4096)])  # 4096 columns: AMX panels of 32 gate rows, two a share
def test_silu_in_the_gate_up_product_gives_the_bits_of_the_two_apart(rows: int, k: int) -> None:
    """quant_kernel.gate_up_silu (the product's epilogue applies SiLU and rounds to bfloat16)
    equals the gate/up product then cpu_ops.silu_mul(bf16=True), bit for bit, at any number of
    rows (across the row blocks of 256 and AMX's panels too); a gated MLP takes it where both
    products are BF16 on vdpbf16ps or AMX tiles."""
    from shardserve.layers import cpu_ops
    from shardserve.loader.quantized import bf16_rows

    g = torch.Generator().manual_seed(rows)
    inter = 80  # five groups of 16 gate rows: claims end inside the gate half
    w = quant_kernel.kernel_layout(bf16_rows(torch.randn(2 * inter, k, generator=g) * 0.3))
    if not quant_kernel.takes_bf16(((0, w),)):
        pytest.skip(f"BF16 products run on {quant_kernel.bf16_path()} here; the fused path is vdpbf16ps's and AMX's")
    x = torch.randn(rows, k, generator=g) * 3
    fused = quant_kernel.gate_up_silu(x, ((0, w),))
    apart = cpu_ops.silu_mul(quant_kernel.linear(x, ((0, w),), 2 * inter), bf16=True)
    assert fused is not None and fused.dtype == torch.bfloat16 and fused.shape == (rows, inter)
    assert torch.equal(fused.view(torch.int16), apart.view(torch.int16))
    # A strided input (a view into wider rows) reads the same rows; so do the rows handed already
    # rounded to bfloat16 (the norm before it rounds them: rms_norm(bf16=True)), strided too.
    wide = torch.cat([x, torch.ones(rows, 8)], dim=1)[:, :k]
    assert torch.equal(quant_kernel.gate_up_silu(wide, ((0, w),)).view(torch.int16), fused.view(torch.int16))
    assert torch.equal(quant_kernel.gate_up_silu(wide.bfloat16(), ((0, w),)).view(torch.int16), fused.view(torch.int16))
    wide16 = torch.cat([x.bfloat16(), torch.full((rows, 32), float("nan"), dtype=torch.bfloat16)], dim=1)[:, :k]
    assert torch.equal(quant_kernel.gate_up_silu(wide16, ((0, w),)).view(torch.int16), fused.view(torch.int16))


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_the_norm_hands_a_product_the_bits_it_would_round(rows: int) -> None:
    """cpu_ops.rms_norm(bf16=True) gives rms_norm's float32 rows rounded to bfloat16 (nearest even,
    NaN kept), and a decoder layer whose products take bfloat16 rows gives, from them, the bits it
    gives from the float32 rows."""
    from shardserve.layers import cpu_ops

    g = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 96, generator=g) * 3, torch.randn(96, generator=g)
    x[0, 5] = float("nan")  # row 0 all NaN after the norm
    n32, n16 = cpu_ops.rms_norm(x, weight, 1e-5), cpu_ops.rms_norm(x, weight, 1e-5, bf16=True)
    assert n16.dtype == torch.bfloat16 and n16.shape == n32.shape
    assert torch.equal(n16[1:].view(torch.int16), n32[1:].bfloat16().view(torch.int16)) and n16[0].isnan().all()
    mlp = bf16_mlp(g)
    if not mlp.takes_bf16_input:
        pytest.skip(f"BF16 products run on {quant_kernel.bf16_path()} here, which rounds its own activations")
    assert torch.equal(mlp(n16[1:]), mlp(n32[1:]))
    mlp.down_proj._bf16_input = False  # the fused SiLU declines: the product and SiLU apart, from bf16 rows
    assert torch.equal(mlp(n16[1:]), mlp(n32[1:]))


def test_the_fused_gate_up_declines_what_it_does_not_take() -> None:
    """Not whole groups of gate rows, two segments, float32 rows, or on AMX columns not whole
    chunks of 32: None, and the MLP runs the product and SiLU apart."""
    from shardserve.loader.quantized import bf16_rows, float_rows

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g)
    odd = quant_kernel.kernel_layout(bf16_rows(torch.randn(2 * 24, 64, generator=g)))
    if not quant_kernel.takes_bf16(((0, odd),)):
        pytest.skip(f"BF16 products run on {quant_kernel.bf16_path()} here; the fused path is vdpbf16ps's and AMX's")
    assert quant_kernel.gate_up_silu(x, ((0, odd),)) is None  # 24 gate rows: not whole groups of 16
    half = quant_kernel.kernel_layout(bf16_rows(torch.randn(32, 64, generator=g)))
    assert quant_kernel.gate_up_silu(x, ((0, half), (32, half))) is None
    assert quant_kernel.gate_up_silu(x, ((0, quant_kernel.kernel_layout(float_rows(torch.randn(64, 64)))),)) is None
    if quant_kernel.bf16_path() == "amx":  # a tile reads 32 columns a row: 48 would read into the next row
        w48 = quant_kernel.kernel_layout(bf16_rows(torch.randn(64, 48, generator=g)))
        assert not quant_kernel.takes_bf16(((0, w48),))
        assert quant_kernel.gate_up_silu(torch.randn(4, 48, generator=g), ((0, w48),)) is None
