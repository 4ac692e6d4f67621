"""The Triton paged kernels, run on CPU tensors under Triton's interpreter (the same source a GPU
compiles), against a float64 gather reference: decodes across page boundaries, of length 1, 0 and
not a multiple of the page, GQA ratios 1, 3 and 8 and uneven groups, split over long contexts;
extends with and without a cached prefix; log-sum-exp within 1e-5. Then the backend against the
torch backend on a mixed step, and whole models against transformers through it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shardserve.attention.backend import Heads
from shardserve.attention.select import choose_backend, triton_kernels
from shardserve.attention.torch_backend import TorchBackend

CPU = torch.device("cpu")
tk = triton_kernels(CPU)


def pool(heads_kv: int, dim: int, ps: int, lens: list[int], seed: int = 0):
    """Random caches and a shuffled block table with room for every context."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // ps) for n in lens + [1])
    pages = len(lens) * width + 3
    kc = torch.randn(pages * ps, heads_kv, dim, generator=g)
    vc = torch.randn(pages * ps, heads_kv, dim, generator=g)
    table = torch.randperm(pages, generator=g)[: len(lens) * width].view(len(lens), width)
    return kc, vc, table, g


def reference(q, kc, vc, table_row, n_keys, q_pos, kv_of_q, ps, scale):
    """q [T, H, d] at positions q_pos, over the first n_keys keys of one block table row."""
    pos = torch.arange(n_keys)
    slots = table_row[pos // ps] * ps + pos % ps
    k, v = kc[slots][:, kv_of_q].double(), vc[slots][:, kv_of_q].double()
    s = torch.einsum("thd,nhd->htn", q.double(), k) * scale
    s = s.masked_fill(~(pos[None, :] <= q_pos[:, None])[None], float("-inf"))
    lse = torch.logsumexp(s, -1).T
    out = torch.einsum("htn,nhd->thd", torch.softmax(s, -1).nan_to_num(0.0), v)
    return out, lse


DECODE = [  # heads, kv_of_q, dim, page size, context lengths
    (4, (0, 1, 2, 3), 16, 4, [1, 4, 5, 9]),  # GQA 1, exactly a page, one past
    (6, (0, 0, 0, 1, 1, 1), 32, 8, [17, 3, 1100]),  # GQA 3; 1100 keys: three splits
    (8, (0,) * 8, 24, 16, [33, 1, 0, 600]),  # GQA 8, head dim not a power of two, an empty row
    (5, (0, 0, 0, 1, 1), 16, 8, [12, 40]),  # uneven groups (a replicated KV head): one head a program
]


@pytest.mark.parametrize("heads,kv_of_q,dim,ps,lens", DECODE)
def test_paged_decode_matches_the_reference(heads, kv_of_q, dim, ps, lens):
    kc, vc, table, g = pool(max(kv_of_q) + 1, dim, ps, lens)
    q = torch.randn(len(lens), heads, dim, generator=g)
    info = Heads(heads, max(kv_of_q) + 1, dim, dim**-0.5, kv_of_q)
    splits = tk.decode_splits(max(lens))
    assert splits == -(-max(lens) // tk.KEYS_PER_SPLIT)
    lse = torch.empty(len(lens), heads)
    out = tk.paged_decode(q, kc, vc, table, torch.tensor(lens), info.kv_index, info.group, ps, info.scale, splits,
                          lse=lse)
    for b, n in enumerate(lens):
        ref, ref_lse = reference(q[b : b + 1], kc, vc, table[b], n, torch.tensor([n - 1]), info.kv_index, ps,
                                 info.scale)
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])) and torch.isinf(lse[b]).all()
            continue
        torch.testing.assert_close(out[b].double(), ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[b].double(), ref_lse[0], atol=1e-5, rtol=1e-5)


def test_a_row_is_the_same_whatever_else_is_in_the_batch():
    """Splits cover a fixed number of keys, so a short row beside a long one is computed alike."""
    kc, vc, table, g = pool(2, 16, 8, [30, 1500])
    q = torch.randn(2, 4, 16, generator=g)
    kv = torch.tensor([0, 0, 1, 1])
    both = tk.paged_decode(q, kc, vc, table, torch.tensor([30, 1500]), kv, 2, 8, 0.25, tk.decode_splits(1500))
    alone = tk.paged_decode(q[:1], kc, vc, table[:1], torch.tensor([30]), kv, 2, 8, 0.25, tk.decode_splits(30))
    assert torch.equal(both[0], alone[0])


EXTEND = [  # heads, kv heads, dim, page size, chunks (new tokens, context through them)
    (4, 2, 16, 4, [(5, 5), (3, 10), (1, 7)]),  # fresh, after a prefix, one token
    (3, 1, 32, 8, [(40, 40), (70, 100)]),  # several query blocks, a cached prefix of 30
    (8, 8, 8, 16, [(33, 65)]),
]


@pytest.mark.parametrize("heads,hkv,dim,ps,chunks", EXTEND)
def test_paged_extend_matches_the_reference(heads, hkv, dim, ps, chunks):
    kc, vc, table, g = pool(hkv, dim, ps, [kv for _, kv in chunks])
    t = sum(n for n, _ in chunks)
    q = torch.randn(t, heads, dim, generator=g)
    info = Heads(heads, hkv, dim, dim**-0.5, tuple(i // (heads // hkv) for i in range(heads)))
    starts = torch.tensor([0] + [n for n, _ in chunks]).cumsum(0)
    out, lse = torch.empty(t, heads, dim), torch.empty(t, heads)
    tk.paged_extend(q, kc, vc, table, starts, torch.tensor([kv for _, kv in chunks]), info.kv_index,
                    max(n for n, _ in chunks), ps, info.scale, out, lse)
    for c, (n, kv) in enumerate(chunks):
        rows = slice(int(starts[c]), int(starts[c + 1]))
        ref, ref_lse = reference(q[rows], kc, vc, table[c], kv, torch.arange(kv - n, kv), info.kv_index, ps,
                                 info.scale)
        torch.testing.assert_close(out[rows].double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[rows].double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_the_backend_matches_torch_on_a_mixed_step():
    """Decodes and two prefill chunks (one fresh, one after a cached prefix): the same output and
    the same cache writes as gather + SDPA."""
    heads, kv_of_q, dim, ps = 6, (0, 0, 0, 1, 1, 1), 32, 8
    kc, vc, table, g = pool(2, dim, ps, [5, 30, 64, 12, 40])
    pages = [row.tolist() for row in table]
    decodes = list(zip(pages[:3], [5, 30, 64]))
    prefills = [(pages[3], 12, 12), (pages[4], 9, 40)]
    t = 3 + 12 + 9
    q, k, v = torch.randn(t, heads, dim, generator=g), torch.randn(t, 2, dim, generator=g), torch.randn(
        t, 2, dim, generator=g)
    info = Heads(heads, 2, dim, dim**-0.5, kv_of_q)
    outs, caches = [], []
    for backend in (TorchBackend(), choose_backend("triton", CPU, torch.float32)):
        meta = backend.prepare(ps, decodes, prefills, CPU)
        kcc, vcc = kc.clone(), vc.clone()
        outs.append(backend.forward(info, q, k, v, kcc, vcc, meta))
        caches.append((kcc, vcc))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


# Qwen3 is Llama with q/k norms, applied before the kernels: not run here (CI time).
@pytest.mark.parametrize("arch", ["llama", "deepseek_v2", "phi3"])
def test_whole_models_match_transformers_through_triton(tiny_model, arch):
    from test_equivalence import check

    core = check(tiny_model, arch, attention_backend="triton", max_num_batched_tokens=16)
    assert core.runner.attention.describe() == "triton (interpreted on the CPU)"


def test_half_precision_under_the_interpreter_is_refused():
    with pytest.raises(ValueError, match="--attention-backend triton on the CPU runs under Triton's interpreter, "
                                         "float32 only, not bfloat16"):
        choose_backend("triton", CPU, torch.bfloat16)


def test_triton_missing_is_one_line_naming_the_flag(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_triton(name, *args, **kw):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("No module named 'triton'")
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_triton)
    monkeypatch.delitem(__import__("sys").modules, "shardserve.attention.triton_kernels")
    with pytest.raises(ValueError, match=r"--attention-backend triton needs Triton \(pip install triton\)"):
        choose_backend("triton", CPU, torch.float32)


def test_the_small_operators_match_their_torch_formulas():
    """layers/triton_ops.py (what layers/gpu_ops.py runs on CUDA) against the formulas the layers
    use elsewhere, in float32 (the interpreter misreads half precision: tests/cuda has bfloat16)."""
    from shardserve.platform import triton_module

    ops = triton_module("shardserve.layers.triton_ops", CPU)
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6),):
        x, w = torch.randn(5, 3, 48, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)
        v = x.float()
        ref = w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ref, atol=tol, rtol=tol)
        gate_up = torch.randn(7, 2 * 40, generator=g).to(dtype)[:, :]
        gate, up = gate_up.chunk(2, dim=-1)
        torch.testing.assert_close(ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, atol=tol, rtol=tol)
        q = torch.randn(6, 4, 32, generator=g).to(dtype)
        cos, sin = torch.randn(6, 16, generator=g), torch.randn(6, 16, generator=g)
        x1, x2 = q.float().chunk(2, dim=-1)
        ref = torch.cat((x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]), -1).to(dtype)
        ops.rotary_(q, cos, sin)
        torch.testing.assert_close(q, ref, atol=tol, rtol=tol)
        # Partial rotary (Phi-4-mini's 3/4): the leading 24 of 32 dims rotated, the rest kept.
        q = torch.randn(6, 4, 32, generator=g).to(dtype)
        cos, sin = torch.randn(6, 12, generator=g), torch.randn(6, 12, generator=g)
        x1, x2 = q[..., :24].float().chunk(2, dim=-1)
        ref = torch.cat((x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None], q[..., 24:]),
                        -1).to(dtype)
        ops.rotary_(q, cos, sin)
        torch.testing.assert_close(q, ref, atol=tol, rtol=tol)


def test_triton_imported_before_its_interpreter_is_refused_in_one_line():
    """Run on the CPU, Triton's kernels need its interpreter on before triton is first imported
    (torch._dynamo imports it): otherwise a one-line refusal, not a failure inside a kernel."""
    code = ("import triton, torch\n"
            "from shardserve.attention.select import BackendUnavailable, triton_kernels\n"
            "try:\n    triton_kernels(torch.device('cpu'))\nexcept BackendUnavailable as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "Triton was imported before its interpreter was turned on: set TRITON_INTERPRET=1" in out.stdout, out.stderr
