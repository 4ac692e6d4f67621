"""Block-quantized weights: the kernels against gguf's own decoder, GGUF checkpoints kept in
their blocks (bytes counted), the C decode loop against the layer-by-layer path, int8 at load,
and the fused small operators against their torch formulas."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from engine_util import record_logits
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import quantize
from gguf_util import finish, gguf_writer, llama_cpp_permute

from shardserve.config import EngineConfig
from shardserve.layers import cpu_ops, quant_kernel
from shardserve.layers.decode_loop import DecodeLoop
from shardserve.layers.embedding import VocabParallelEmbedding
from shardserve.layers.linear import PackedLinear, RowParallelLinear
from shardserve.loader.quantized import FORMATS, QuantWeight, quantize_q8_0
from shardserve.loader.source import LazySource
from shardserve.sampling_params import SamplingParams
from shardserve.scheduler.engine_core import EngineCore

# The kernels round activations to 16-bit fixed point per block of 32 (see quant_matmul.c):
# results agree with dequantize-then-multiply to this fraction of the output's scale.
KERNEL_RTOL = 2e-4


def random_weight(qtype: int, rows: int, cols: int, seed: int = 0) -> QuantWeight:
    """gguf's quantizer where it has one (Q4_0, Q4_1, Q8_0); else random blocks with sane scales."""
    rng = np.random.default_rng(seed)
    if qtype in (2, 3, 8):
        data = quantize(rng.standard_normal((rows, cols), dtype=np.float32), T(qtype))
        return QuantWeight(qtype, torch.from_numpy(np.ascontiguousarray(data)), cols)
    _, block, nbytes = FORMATS[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    scales = (rng.random((rows, cols // block, 1)) * 0.01 + 0.001).astype(np.float16).view(np.uint8)
    if qtype == 12:  # Q4_K: d, dmin first
        raw[:, :, 0:2], raw[:, :, 2:4] = scales, scales
    else:  # Q6_K: d last
        raw[:, :, 208:210] = scales
    return QuantWeight(qtype, torch.from_numpy(raw.reshape(rows, -1)), cols)


@pytest.mark.parametrize("qtype", sorted(FORMATS), ids=[FORMATS[t][0] for t in sorted(FORMATS)])
def test_kernels_equal_dequantize_then_multiply(qtype):
    w = random_weight(qtype, 70, 512)
    ref = w.dequantize()  # gguf's numpy decoder
    torch.testing.assert_close(quant_kernel.dequantize(w), ref, rtol=1e-6, atol=1e-7)
    rows = torch.tensor([5, 0, 69, 5])
    torch.testing.assert_close(quant_kernel.dequantize(w, rows), ref[rows], rtol=1e-6, atol=1e-7)
    g = torch.Generator().manual_seed(1)
    # 1 and 5 rows: the one-row and the 4-row 16-bit paths (and a tail); 21: the float GEMM (and
    # tails); 11: the 16-bit path for Q8_0 (8 rows, then 3), the float GEMM for the others.
    for m in (1, 5, 11, 21):
        x = torch.randn(m, 512, generator=g) * 3
        y = quant_kernel.linear(x, ((0, w),), 70)
        want = x @ ref.T
        scale = float(want.abs().max())
        assert float((y - want).abs().max()) <= KERNEL_RTOL * scale, (m, float((y - want).abs().max()), scale)


@pytest.mark.parametrize("qtype,cols", [(2, 1344), (14, 1536), (0, 1000)], ids=["Q4_0", "Q6_K", "F32"])
def test_float_gemms_and_their_tails(qtype, cols):
    """Both float GEMMs of quant_gemm.c: activation panels (16 to 127 rows: panels of 16, an
    8-wide tail, weight rows in blocks of 6 with a remainder of 70) and weight strips (128 rows
    and more; 130 leaves a tail of 4). Float32 throughout: equal to rounding."""
    w = quant_kernel.float_weight(torch.randn(70, cols)) if qtype == 0 else random_weight(qtype, 70, cols)
    ref = w.dequantize()
    for m in (16, 25, 70, 130):
        x = torch.randn(m, cols)
        want = x @ ref.T
        got = quant_kernel.linear(x, ((0, w),), 70)
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), m


def test_float32_rows_take_the_same_paths_exactly():
    """A float32 weight as F32 rows in the x16 layout (what float checkpoints now hold on the
    CPU): every batch size equals torch's product to float rounding, in as many bytes."""
    w = torch.randn(70, 200)
    q = quant_kernel.float_weight(w)
    assert q.name == "F32x16" and q.nbytes == w.numel() * 4
    torch.testing.assert_close(q.dequantize(), w)
    torch.testing.assert_close(quant_kernel.dequantize(q, torch.tensor([3, 69])), w[[3, 69]])
    for m in (1, 3, 6, 21):
        x = torch.randn(m, 200)
        torch.testing.assert_close(quant_kernel.linear(x, ((0, q),), 70), x @ w.T, rtol=1e-5, atol=1e-5)
    assert quant_kernel.float_weight(torch.randn(4, 12)) is None  # columns not a multiple of 8
    assert quant_kernel.float_weight(w.bfloat16()) is None


def test_mixed_formats_in_one_fused_weight():
    """A fused q/k/v whose pieces come in different formats (Q4_K_M files do this) runs as row
    segments into one output, bias added once."""
    parts = [random_weight(12, 48, 256, 1), random_weight(14, 16, 256, 2), random_weight(8, 16, 256, 3)]
    segments, off = [], 0
    for q in parts:
        segments.append((off, q))
        off += q.rows
    bias = torch.randn(off)
    x = torch.randn(3, 256)
    want = x @ torch.cat([q.dequantize() for q in parts]).T + bias
    for rows in (3, 11, 40):  # 16-bit path, both paths (Q8_0 16-bit, the K-quants float), float GEMM
        xx = x.repeat(rows // 3 + 1, 1)[:rows]
        got = quant_kernel.linear(xx, tuple(segments), off, bias)[:3]
        assert float((got - want).abs().max()) <= KERNEL_RTOL * float(want.abs().max())


def test_slices_follow_block_boundaries():
    w = random_weight(3, 6, 128)
    ref = w.dequantize()
    torch.testing.assert_close(w.narrow(1, 32, 96).dequantize(), ref[:, 32:96])
    torch.testing.assert_close(w.narrow(0, 2, 5).dequantize(), ref[2:5])
    assert w.narrow(1, 16, 64) is None  # a row-parallel cut inside a block: the caller loads floats
    with pytest.raises(ValueError, match="not whole 32-weight blocks"):
        QuantWeight(3, w.data[:, :30], 48)


def test_int8_quantization_error_is_half_a_step():
    w = torch.randn(8, 96) * torch.linspace(0.1, 10, 96)
    q = quantize_q8_0(w)
    assert q.name == "Q8_0" and q.nbytes == 8 * 3 * 34
    step = w.reshape(8, 3, 32).abs().amax(-1, keepdim=True) / 127
    err = (q.dequantize() - w).reshape(8, 3, 32).abs()
    assert bool((err <= step * 0.5 + step * 1e-3).all())  # + the f16 rounding of the scale
    assert quantize_q8_0(torch.randn(4, 40)) is None


def test_fused_small_ops_equal_torch():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=g), torch.randn(64, generator=g)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6), want, rtol=1e-5, atol=1e-6)
    gu = torch.randn(3, 2 * 48, generator=g)
    torch.testing.assert_close(cpu_ops.silu_mul(gu), F.silu(gu[:, :48]) * gu[:, 48:], rtol=1e-5, atol=1e-6)
    gelu = F.gelu(gu[:, :48] * 3, approximate="tanh") * gu[:, 48:]  # Gemma's (wide gates: both tails)
    gu3 = torch.cat((gu[:, :48] * 3, gu[:, 48:]), 1)
    torch.testing.assert_close(cpu_ops.silu_mul(gu3, activation="gelu_pytorch_tanh"), gelu, rtol=1e-5, atol=1e-6)
    h16 = cpu_ops.silu_mul(gu3, bf16=True, activation="gelu_pytorch_tanh")
    assert torch.equal(h16, cpu_ops.silu_mul(gu3, activation="gelu_pytorch_tanh").bfloat16())
    qkv = torch.randn(4, (3 + 1) * 16, generator=g)
    q, k = qkv[:, :48].view(4, 3, 16), qkv[:, 48:].view(4, 1, 16)
    cos, sin = torch.randn(4, 1, 8, generator=g), torch.randn(4, 1, 8, generator=g)

    def rot(t):
        a, b = t.chunk(2, -1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), -1)

    want_q, want_k = rot(q.clone()), rot(k.clone())
    assert cpu_ops.rotary_(q, k, cos, sin)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-6)
    # Partial rotary: tables 6 wide rotate each head's leading 12 of 16 dims, the last 4 kept.
    cos, sin = cos[..., :6].contiguous(), sin[..., :6].contiguous()
    want_q = torch.cat((rot(q[..., :12].clone()), q[..., 12:]), -1)
    want_k = torch.cat((rot(k[..., :12].clone()), k[..., 12:]), -1)
    assert cpu_ops.rotary_(q, k, cos, sin)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- whole models

# Per llama tensor: the block format the tiny GGUF stores it in. q, k, v differ (three segments
# in one fused weight) and so do gate and up.
FORMATS_BY_TENSOR = {"attn_q": T.Q4_1, "attn_k": T.Q4_0, "attn_v": T.Q8_0, "attn_output": T.Q4_1,
                     "ffn_gate": T.Q4_0, "ffn_up": T.Q4_1, "ffn_down": T.Q8_0}
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model, tmp_path_factory) -> str:
    """The tiny llama written as llama.cpp would, its weights in several block formats."""
    _, model = tiny_model("llama")
    cfg, sd = model.config, {k: v.numpy() for k, v in model.state_dict().items()}
    path = str(tmp_path_factory.mktemp("qgguf") / "tiny-q.gguf")
    writer = gguf_writer(path, "llama", cfg)
    writer.add_tensor("token_embd.weight", quantize(sd["model.embed_tokens.weight"], T.Q8_0), raw_dtype=T.Q8_0)
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    writer.add_tensor("output.weight", quantize(sd["lm_head.weight"], T.Q8_0), raw_dtype=T.Q8_0)
    for i in range(cfg.num_hidden_layers):
        for stem, hf in HF_NAMES.items():
            w = sd[f"model.layers.{i}.{hf}.weight"]
            if stem in ("attn_q", "attn_k"):
                w = llama_cpp_permute(w, cfg.num_attention_heads if stem == "attn_q" else cfg.num_key_value_heads)
            qtype = FORMATS_BY_TENSOR.get(stem)
            if qtype is None:
                writer.add_tensor(f"blk.{i}.{stem}.weight", w)
            else:
                writer.add_tensor(f"blk.{i}.{stem}.weight", quantize(w, qtype), raw_dtype=qtype)
    finish(writer)
    return path


def run(path: str, prompts: list[list[int]], n: int = 12,
        **cfg) -> tuple[list[list[int]], list[torch.Tensor], EngineCore]:
    core = EngineCore(EngineConfig(model=path, show_progress=False, **{"num_pages": 64, **cfg}))
    seen = record_logits(core)
    reqs = [core.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0)) for i, p in enumerate(prompts)]
    while core.has_unfinished():
        core.step()
    return [r.output_token_ids for r in reqs], [torch.stack(seen[r.request_id]) for r in reqs], core


PROMPTS = [[5, 9, 2, 77, 3], list(range(20, 60)), [300]]


def test_gguf_weights_stay_in_their_blocks(tiny_gguf):
    core = run(tiny_gguf, PROMPTS[:1], n=2)[2]
    model = core.runner.model
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.quant is not None and m.weight is None and m.packed is None for m in linears)
    assert [len(m.quant) for m in linears[:4]] == [3, 1, 2, 1]  # q/k/v and gate/up keep their formats apart
    # Q4_0/Q4_1/Q8_0 are held in the kernels' x16 layout: the file's bytes, regrouped
    assert model.embed_tokens.quant.name == "Q8_0x16" and model.embed_tokens.weight is None
    held = sum(q.nbytes for m in linears for _, q in m.quant) + model.embed_tokens.quant.nbytes \
        + model.lm_head.quant.nbytes
    in_file = sum(int(t.n_bytes) for t in GGUFReader(tiny_gguf).tensors if t.tensor_type != T.F32)
    assert held == in_file  # bytes in memory are the file's blocks, nothing expanded


def test_quantized_logits_match_the_expanded_model(tiny_gguf):
    tokens, logits, _ = run(tiny_gguf, PROMPTS)
    want_tokens, want_logits, _ = run(tiny_gguf, PROMPTS, quantization="none")
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):
        assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())


# The 16-bit path; both in one step (11 rows: Q8_0 16-bit, Q4_0/Q4_1 on panels, some of them in
# one fused q/k/v); the float GEMM on activation panels; on weight strips (128 rows and more).
@pytest.mark.parametrize("streams", [3, 11, 18, 130])
def test_decode_loop_equals_the_layer_by_layer_path(tiny_gguf, monkeypatch, streams):
    prompts = [PROMPTS[i % 3][i:] + [i] for i in range(streams)]
    calls = []
    real_run = DecodeLoop.run
    monkeypatch.setattr(DecodeLoop, "run", lambda self, x, ctx: calls.append(x.shape[0]) or real_run(self, x, ctx))
    pages = {"num_pages": 4 * streams, "max_running_requests": streams}
    tokens, logits, _ = run(tiny_gguf, prompts, **pages)
    assert calls and max(calls) == streams  # decode steps took the C loop, all rows at once
    monkeypatch.setattr(DecodeLoop, "build", classmethod(lambda cls, layers: None))
    slow_tokens, slow_logits, _ = run(tiny_gguf, prompts, **pages)
    assert tokens == slow_tokens
    for got, want in zip(logits, slow_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # q/k/v bias; per-head q/k norms
def test_int8_at_load(tiny_model, arch, monkeypatch):
    path, _ = tiny_model(arch)
    tokens, logits, core = run(path, PROMPTS, quantization="int8")
    linears = [m for m in core.runner.model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.quant is not None and m.quant[0][1].name == "Q8_0x16" for m in linears)
    want_tokens, want_logits, _ = run(path, PROMPTS, quantization="none")
    for got, want in zip(logits, want_logits):  # one int8 step per 32 weights: ~0.4% of each weight
        assert float((got - want).abs().max()) <= 0.03 * float(want.abs().max())
    monkeypatch.setattr(DecodeLoop, "build", classmethod(lambda cls, layers: None))
    assert run(path, PROMPTS, quantization="int8")[0] == tokens  # the C loop and the modules agree


def test_quantization_choices_and_refusals(tiny_gguf, tiny_model, caplog):
    with pytest.raises(ValueError, match="quantization 'int8' quantizes a float"):
        EngineCore(EngineConfig(model=tiny_gguf, show_progress=False, num_pages=8, quantization="int8"))
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model=tiny_gguf, quantization="int4")
    with pytest.raises(ValueError, match="quantization 'int8': --dtype bfloat16 asks for bfloat16 weights"):
        EngineCore(EngineConfig(model=tiny_model("llama")[0], show_progress=False, num_pages=8, quantization="int8",
                                dtype="bfloat16"))
    with caplog.at_level(logging.WARNING):
        core = EngineCore(EngineConfig(model=tiny_gguf, show_progress=False, num_pages=8, dtype="bfloat16"))
    assert "GGUF weights are expanded to bfloat16" in caplog.text
    # as bfloat16 rows for the C kernels, float32 around them (quant_kernel.bf16_weights)
    assert {q.name for m in core.runner.model.modules() if isinstance(m, PackedLinear)
            for _, q in m.quant} == {"BF16x16"}
    assert core.runner.dtype == torch.float32 and core.runner.model._decode_loop() is not None
    expanded = EngineCore(EngineConfig(model=tiny_gguf, show_progress=False, num_pages=8, quantization="none"))
    emb = expanded.runner.model.embed_tokens
    assert isinstance(emb, VocabParallelEmbedding) and emb.quant is None and emb.weight is not None


class _Rank:
    """The size and rank a row-parallel layer reads at construction (no collective is run)."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank


def test_row_parallel_shards_keep_blocks_only_on_block_boundaries():
    """Columns [32, 64) of a Q4_1 weight stay blocks; [48, 64) (a cut inside a block, as 4 heads
    of 16 split over 3 ranks) loads as floats (held as F32 rows); both multiply like the
    expanded slice."""
    w = random_weight(3, 8, 64)
    ref = w.dequantize()
    x = torch.randn(2, 64)
    for in_range, kept in (((32, 64), True), ((48, 64), False)):
        layer = RowParallelLinear(64, 8, False, _Rank(3, 1), torch.float32, torch.device("cpu"), in_range=in_range)
        src = LazySource("w", w.dequantize, lambda: w)
        layer.weight.weight_loader(layer.weight, src, None)
        layer.process_after_loading()
        assert [q.name for _, q in layer.quant] == (["Q4_1x16"] if kept else ["F32x16"])
        lo, hi = in_range
        want = x[:, lo:hi] @ ref[:, lo:hi].T
        got = layer.matmul(x[:, lo:hi].contiguous())
        assert float((got - want).abs().max()) <= KERNEL_RTOL * float(want.abs().max())


def test_int8_refusals_come_before_any_process_starts(tiny_gguf, tiny_model):
    from shardserve.distributed.layout import LayoutError
    from shardserve.llm import LLM

    with pytest.raises(LayoutError, match="--quantization int8 quantizes a safetensors checkpoint"):
        LLM(tiny_gguf, quantization="int8", show_progress=False)
    with pytest.raises(LayoutError, match="--quantization int8 runs on the CPU in float32, not --dtype bfloat16"):
        LLM(tiny_model("llama")[0], quantization="int8", dtype="bfloat16", show_progress=False)
