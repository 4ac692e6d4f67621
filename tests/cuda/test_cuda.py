"""On a GPU (marker `cuda`; skipped without one): the Triton kernels compiled for the device
against a float64 reference, and whole tiny models in bfloat16 and float32 against transformers
on the same GPU. scripts/gpu_check.sh runs these; the CPU suite covers the same kernel source
under Triton's interpreter (tests/unit/test_triton_attention.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
GPU = torch.device("cuda", 0)


def _reference(q, kc, vc, row, n, q_pos, kv_of_q, ps, scale):
    pos = torch.arange(n, device=q.device)
    slots = row[pos // ps] * ps + pos % ps
    k, v = kc[slots][:, kv_of_q].double(), vc[slots][:, kv_of_q].double()
    s = torch.einsum("thd,nhd->htn", q.double(), k) * scale
    s = s.masked_fill(~(pos[None, :] <= q_pos[:, None])[None], float("-inf"))
    return torch.einsum("htn,nhd->thd", torch.softmax(s, -1), v), torch.logsumexp(s, -1).T


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,hkv,dim,ps,lens", [(8, 8, 64, 16, [1, 16, 17, 700]), (32, 8, 128, 16, [5, 3000]),
                                                   (12, 4, 64, 32, [0, 33])])
def test_kernels_on_the_gpu(dtype, tol, heads, hkv, dim, ps, lens):
    from shardserve.attention.backend import Heads
    from shardserve.attention.select import triton_kernels

    tk = triton_kernels(GPU)
    g = torch.Generator(device=GPU).manual_seed(0)
    width = max(-(-n // ps) for n in lens + [1])
    pages = len(lens) * width + 2
    kc = torch.randn(pages * ps, hkv, dim, device=GPU, generator=g).to(dtype)
    vc = torch.randn(pages * ps, hkv, dim, device=GPU, generator=g).to(dtype)
    table = torch.randperm(pages, device=GPU, generator=g)[: len(lens) * width].view(len(lens), width)
    info = Heads(heads, hkv, dim, dim**-0.5, tuple(i // (heads // hkv) for i in range(heads)), GPU)
    q = torch.randn(len(lens), heads, dim, device=GPU, generator=g).to(dtype)
    lse = torch.empty(len(lens), heads, device=GPU)
    out = tk.paged_decode(q, kc, vc, table, torch.tensor(lens, device=GPU), info.kv_index, info.group, ps,
                          info.scale, tk.decode_splits(max(lens)), lse=lse)
    for b, n in enumerate(lens):
        if n:
            ref, ref_lse = _reference(q[b : b + 1], kc, vc, table[b], n, torch.tensor([n - 1], device=GPU),
                                      info.kv_index, ps, info.scale)
            torch.testing.assert_close(out[b].double(), ref[0], atol=tol, rtol=tol)
            torch.testing.assert_close(lse[b].double(), ref_lse[0], atol=tol, rtol=tol)
    chunks = [(n, n) for n in lens if n] + [(min(40, n), n) for n in lens if n]  # fresh, and after a prefix
    t = sum(c for c, _ in chunks)
    tables = torch.cat([table[[i for i, n in enumerate(lens) if n]]] * 2)
    qq = torch.randn(t, heads, dim, device=GPU, generator=g).to(dtype)
    out, lse = torch.empty_like(qq), torch.empty(t, heads, device=GPU)
    starts = torch.tensor([0] + [c for c, _ in chunks], device=GPU).cumsum(0)
    tk.paged_extend(qq, kc, vc, tables, starts, torch.tensor([n for _, n in chunks], device=GPU), info.kv_index,
                    max(c for c, _ in chunks), ps, info.scale, out, lse)
    for c, (m, n) in enumerate(chunks):
        rows = slice(int(starts[c]), int(starts[c + 1]))
        ref, ref_lse = _reference(qq[rows], kc, vc, tables[c], n, torch.arange(n - m, n, device=GPU), info.kv_index,
                                  ps, info.scale)
        torch.testing.assert_close(out[rows].double(), ref, atol=tol, rtol=tol)
        torch.testing.assert_close(lse[rows].double(), ref_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_tiny_models_match_transformers_on_the_gpu(tiny_model, arch, dtype, async_scheduling):
    from shardserve.config import EngineConfig
    from shardserve.sampling_params import SamplingParams
    from shardserve.scheduler.engine_core import EngineCore

    path, model = tiny_model(arch)
    ref_model = model.to(device=GPU, dtype=getattr(torch, dtype))
    g = torch.Generator().manual_seed(7)
    batch = [torch.randint(model.config.vocab_size, (n,), generator=g).tolist() for n in (1, 7, 40)]
    core = EngineCore(EngineConfig(model=path, show_progress=False, num_pages=64, dtype=dtype, device="cuda",
                                   async_scheduling=async_scheduling))
    assert core.runner.attention.name == "triton"
    reqs = [core.add_request(str(i), p, SamplingParams(max_tokens=16, temperature=0)) for i, p in enumerate(batch)]
    while core.has_unfinished():
        core.step()
    core.close()
    assert core.max_in_flight == (2 if async_scheduling else 1)
    with torch.no_grad():
        for p, r in zip(batch, reqs):
            ref = ref_model.generate(torch.tensor([p], device=GPU), max_new_tokens=16, min_new_tokens=16,
                                     do_sample=False)[0, len(p):].tolist()
            assert r.output_token_ids == ref
    model.to(device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_small_operators_on_the_gpu(dtype, tol):
    from shardserve.layers import gpu_ops

    g = torch.Generator(device=GPU).manual_seed(0)
    x, w = torch.randn(5, 3, 48, device=GPU, generator=g).to(dtype), torch.randn(48, device=GPU, generator=g).to(dtype)
    v = x.float()
    ref = w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    torch.testing.assert_close(gpu_ops.rms_norm(x, w, 1e-6), ref, atol=tol, rtol=tol)
    gate_up = torch.randn(7, 80, device=GPU, generator=g).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(gpu_ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, atol=tol, rtol=tol)
    q, k = (torch.randn(6, h, 32, device=GPU, generator=g).to(dtype) for h in (4, 2))
    cos, sin = (torch.randn(6, 1, 16, device=GPU, generator=g) for _ in range(2))
    refs = []
    for t in (q, k):
        x1, x2 = t.float().chunk(2, dim=-1)
        refs.append(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(dtype))
    assert gpu_ops.rotary_(q, k, cos, sin)
    torch.testing.assert_close(q, refs[0], atol=tol, rtol=tol)
    torch.testing.assert_close(k, refs[1], atol=tol, rtol=tol)


@pytest.mark.parametrize("kw", [dict(temperature=0.8), dict(temperature=0.7, top_p=0.9, min_p=0.02),
                                dict(temperature=1.0, top_k=40), dict(temperature=5.0, top_p=0.99)])
def test_batched_sampling_on_the_gpu(kw):
    """The batched draw on CUDA tensors and generators equals the whole-row filters drawn at the
    same uniform numbers (float64, on the GPU)."""
    from shardserve.engine.batch_sampling import sample_rows
    from shardserve.engine.sampler import filter_logits
    from shardserve.sampling_params import SamplingParams

    g = torch.Generator(device=GPU).manual_seed(0)
    rows = torch.randn(16, 6000, device=GPU, generator=g) * 4
    p = SamplingParams(**kw)
    got = sample_rows(rows, [p] * 16, [torch.Generator(device=GPU).manual_seed(s) for s in range(16)])
    want = []
    for s in range(16):
        u = float(torch.rand(1, dtype=torch.float64, device=GPU, generator=torch.Generator(device=GPU).manual_seed(s)))
        cdf = filter_logits(rows[s], p).double().softmax(-1).cumsum(-1)
        want.append(int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64, device=GPU),
                                           right=True)))
    assert got == want
