"""The CPU fast paths: the C decode kernel against a plain reference and the torch (gather + SDPA)
path, the backend choice, and oneDNN-packed linear weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardserve import native
from shardserve.attention import cpu_kernel
from shardserve.attention.backend import Heads, write_cache
from shardserve.attention.cpu_backend import CpuBackend
from shardserve.attention.metadata import build_metadata
from shardserve.attention.torch_backend import TorchBackend
from shardserve.config import EngineConfig
from shardserve.layers.linear import PackedLinear
from shardserve.layers.moe import SparseMoE
from shardserve.scheduler.engine_core import EngineCore


def reference(q, k_cache, v_cache, tables, lens, kv_of_q, page_size, scale):
    out = torch.empty_like(q)
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        slots = tables[b][pos // page_size] * page_size + pos % page_size
        k = k_cache[slots][:, kv_of_q].transpose(0, 1)  # [H, n, D]
        v = v_cache[slots][:, kv_of_q].transpose(0, 1)
        out[b] = F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, scale=scale).squeeze(1)
    return out


def random_case(heads, kv_of_q, dim, page_size, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    hkv = max(kv_of_q) + 1
    pages = [-(-n // page_size) for n in lens]
    num_pages = sum(pages) + 3
    order = torch.randperm(num_pages, generator=g).tolist()  # pages scattered over the pool
    page_lists, at = [], 0
    for n in pages:
        page_lists.append(order[at : at + n])
        at += n
    k_cache = torch.randn(num_pages * page_size, hkv, dim, generator=g)
    v_cache = torch.randn(num_pages * page_size, hkv, dim, generator=g)
    q = torch.randn(len(lens), heads, dim, generator=g)
    return q, k_cache, v_cache, page_lists


@pytest.mark.parametrize("heads,kv_of_q,dim,page_size", [
    (9, (0, 0, 0, 1, 1, 1, 2, 2, 2), 64, 16),   # SmolLM2's grouping, vector path
    (4, (0, 1, 2, 3), 32, 4),                  # no grouping
    (5, (0, 0, 0, 1, 1), 24, 3),               # uneven groups (a TP rank's share), scalar path
    (2, (0, 0), 16, 1),                        # one-token pages
    (8, (0,) * 8, 576, 16),                    # latent attention: one cache head, 256 + 256 + 64 chunks
    (3, (0, 0, 0), 48, 4),                     # 32 + 16
])
def test_kernel_matches_reference(heads, kv_of_q, dim, page_size):
    lens = [1, 2, page_size, page_size + 1, 37, 200]
    q, kc, vc, page_lists = random_case(heads, kv_of_q, dim, page_size, lens)
    meta = build_metadata(page_size, list(zip(page_lists, lens)), [], torch.device("cpu"), paged_decode=True)
    kv = torch.tensor(kv_of_q)
    scale = dim**-0.5
    got = cpu_kernel.paged_decode(q, kc, vc, meta.paged.block_tables, meta.paged.context_lens, kv, page_size, scale)
    want = reference(q, kc, vc, meta.paged.block_tables, meta.paged.context_lens, kv, page_size, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def tables_of(page_lists):
    """Block tables by hand: build_metadata wants at least one token per sequence."""
    width = max(1, max(len(p) for p in page_lists))
    return torch.tensor([p + [0] * (width - len(p)) for p in page_lists], dtype=torch.long)


def reference_lse(q, k_cache, v_cache, tables, lens, kv_of_q, page_size, scale, bf16_probs=False):
    """out and log-sum-exp of the scaled scores in float64; empty contexts give 0 and -inf. With
    bf16_probs, the probabilities rounded to bfloat16 (float32 first) before they weigh the values."""
    b, h, d = q.shape
    out, lse = torch.zeros(b, h, d, dtype=torch.float64), torch.empty(b, h, dtype=torch.float64)
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        slots = tables[i][pos // page_size] * page_size + pos % page_size
        k = k_cache[slots][:, kv_of_q].transpose(0, 1).double()  # [H, n, D]
        v = v_cache[slots][:, kv_of_q].transpose(0, 1).double()
        s = scale * torch.einsum("hd,hnd->hn", q[i].double(), k)
        lse[i] = torch.logsumexp(s, dim=1)
        if n:
            p = torch.softmax(s, dim=1)
            out[i] = torch.einsum("hn,hnd->hd", p.float().bfloat16().double() if bf16_probs else p, v)
    return out, lse


@pytest.mark.parametrize("heads,kv_of_q,dim,page_size", [
    (5, (0, 0, 0, 1, 1), 24, 3),    # uneven groups, scalar path
    (9, (0, 0, 0, 1, 1, 1, 2, 2, 2), 64, 16),  # vector path
])
def test_kernel_lse_and_empty_contexts(heads, kv_of_q, dim, page_size):
    """Empty contexts amid sequences spanning several pages, the last one partly filled."""
    lens = [0, 2 * page_size + 1, 0, 1, 5 * page_size - 1, 0, 3 * page_size]
    q, kc, vc, page_lists = random_case(heads, kv_of_q, dim, page_size, lens, seed=2)
    tables, ctx, kv = tables_of(page_lists), torch.tensor(lens), torch.tensor(kv_of_q)
    scale = dim**-0.5
    lse = torch.full((len(lens), heads), float("nan"))
    out = torch.full((len(lens), heads, dim), float("nan"))
    got = cpu_kernel.paged_decode(q, kc, vc, tables, ctx, kv, page_size, scale, out=out, lse=lse)
    assert got is out
    want_out, want_lse = reference_lse(q, kc, vc, tables, ctx, kv, page_size, scale)
    empty = ctx == 0
    assert torch.all(lse[empty] == float("-inf")) and torch.all(out[empty] == 0)
    torch.testing.assert_close(out, want_out.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse[~empty], want_lse[~empty].float(), atol=1e-4, rtol=1e-4)
    # Only empty sequences: no scores at all, still no NaN.
    cpu_kernel.paged_decode(q[:2], kc, vc, tables[[0, 2]], ctx[[0, 2]], kv, page_size, scale, out=out[:2],
                            lse=lse[:2])
    assert torch.all(out[:2] == 0) and torch.all(lse[:2] == float("-inf"))


@pytest.mark.skipif(not cpu_kernel.bf16_cache((64, 64)), reason="a bfloat16 KV cache needs AVX512-BF16")
@pytest.mark.parametrize("heads,kv_of_q,dim,page_size", [
    (9, (0, 0, 0, 1, 1, 1, 2, 2, 2), 64, 16),  # SmolLM2's grouping
    (5, (0, 0, 0, 1, 1), 32, 3),                # uneven groups, pages of 3
    (4, (0, 0, 1, 1), 128, 16),
    (2, (0, 1), 256, 1),                        # the widest head; one-token pages
    (9, (0,) * 9, 32, 16),                      # a group of 9 summed as 8 and 1
    (4, (0, 0, 0, 0), 96, 16),                  # widths between the powers of two: groups of 2
    (3, (0, 0, 1), 160, 8),
    (2, (0, 0), 192, 16),
    (2, (0, 0), 224, 16),
])
def test_bf16_cache_kernel(heads, kv_of_q, dim, page_size):
    """A bfloat16 cache: the float64 attention of the bfloat16-rounded query over the cached
    keys and values to float32 rounding, lse included (on AMX tiles, with pages of whole tiles
    of 16 keys, of the probabilities rounded to bfloat16 too: to a bfloat16 step of a
    probability times a value, since the reference's float64 probabilities may round the other
    way near a tie; unrounded ones are 1e-3 off); an empty context gives 0 and -inf; each row
    alone equals it among the others, bit for bit."""
    lens = [0, 1, 2, page_size, page_size + 1, 37, 200]
    q, kc, vc, page_lists = random_case(heads, kv_of_q, dim, page_size, lens, seed=5)
    kc, vc = kc.bfloat16(), vc.bfloat16()
    tables, ctx, kv = tables_of(page_lists), torch.tensor(lens), torch.tensor(kv_of_q)
    scale = dim**-0.5
    lse = torch.empty(len(lens), heads)
    got = cpu_kernel.paged_decode(q, kc, vc, tables, ctx, kv, page_size, scale, lse=lse)
    amx = "values on amx tiles" in native.kernel_paths(cpu_kernel.load()) and page_size % 16 == 0
    want_out, want_lse = reference_lse(q.bfloat16().float(), kc.float(), vc.float(), tables, ctx, kv, page_size,
                                       scale, bf16_probs=amx)
    assert torch.all(got[0] == 0) and torch.all(lse[0] == float("-inf"))
    torch.testing.assert_close(got, want_out.float(), atol=1e-4 if amx else 2e-6, rtol=1e-5)
    torch.testing.assert_close(lse[1:], want_lse[1:].float(), atol=1e-5, rtol=1e-5)
    for i in range(len(lens)):
        alone = cpu_kernel.paged_decode(q[i: i + 1], kc, vc, tables[i: i + 1], ctx[i: i + 1], kv, page_size, scale)
        assert torch.equal(alone[0], got[i]), i


@pytest.mark.parametrize("heads,kv_of_q,dim,ctx", [
    (9, (0, 0, 0, 1, 1, 1, 2, 2, 2), 64, 203),  # SmolLM2: 16 rows x 3 heads, 48 columns a KV head
    (16, (0,) * 16, 32, 203),                   # 256 columns of one KV head: 16 column tiles
    (3, (0, 1, 2), 96, 203),                    # three chunks of 32 dims
    (32, tuple(h // 8 for h in range(32)), 32, 8300),  # 32 heads x 8300 keys: blocks of 8 rows
])
def test_bf16_cache_prefill_rows_equal_their_decodes(heads, kv_of_q, dim, ctx):
    """A prefill chunk's rows share a block table and go through the kernel together (16 a block,
    8 where a thread's scores would pass 16 MiB; on AMX the scores and values of all their heads
    that read a KV head in shared tiles): each row equals itself decoded alone, bit for bit, and
    the float64 attention to float32 rounding (on AMX of the probabilities rounded to bfloat16, as
    test_bf16_cache_kernel)."""
    page_size, n = 16, 21  # the chunk's last row sees ctx keys; the first ctx - 20
    q, kc, vc, pages = random_case(heads, kv_of_q, dim, page_size, [ctx], seed=9)
    q = torch.randn(n, heads, dim, generator=torch.Generator().manual_seed(10))
    kc, vc = kc.bfloat16(), vc.bfloat16()
    table = tables_of(pages)
    tables, lens, kv = table.expand(n, -1).contiguous(), torch.arange(ctx - n + 1, ctx + 1), torch.tensor(kv_of_q)
    scale = dim**-0.5
    got = cpu_kernel.paged_decode(q, kc, vc, tables, lens, kv, page_size, scale)
    amx = "values on amx tiles" in native.kernel_paths(cpu_kernel.load())
    want, _ = reference_lse(q.bfloat16().float(), kc.float(), vc.float(), tables, lens, kv, page_size, scale,
                            bf16_probs=amx)
    torch.testing.assert_close(got, want.float(), atol=1e-4 if amx else 2e-6, rtol=1e-5)
    for i in range(n):
        alone = cpu_kernel.paged_decode(q[i: i + 1], kc, vc, tables[i: i + 1], lens[i: i + 1], kv, page_size, scale)
        assert torch.equal(alone[0], got[i]), i


def test_a_cache_the_kernel_cannot_read_is_refused():
    q, kc, vc, pages = random_case(2, (0, 0), 16, 4, [5])
    tables, lens, kv = tables_of(pages), torch.tensor([5]), torch.tensor([0, 0])
    with pytest.raises(ValueError, match="float32 or bfloat16 both"):
        cpu_kernel.paged_decode(q, kc.half(), vc.half(), tables, lens, kv, 4, 0.25)
    with pytest.raises(ValueError, match="float32 or bfloat16 both"):
        cpu_kernel.paged_decode(q, kc, vc.bfloat16(), tables, lens, kv, 4, 0.25)
    with pytest.raises(ValueError, match="no bfloat16 cache of 16-wide heads"):
        cpu_kernel.paged_decode(q, kc.bfloat16(), vc.bfloat16(), tables, lens, kv, 4, 0.25)


def test_a_fresh_prefill_reads_its_keys_as_a_bfloat16_cache_holds_them():
    """By SDPA (no batch invariance), a chunk without context attends to its own keys rounded as
    the cache holds them, as a chunk after a cached prefix reads them back: the same numbers."""
    heads, dim, ps, n = 2, 32, 4, 9
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(n, heads, dim, generator=g) for _ in range(3))
    kc = torch.zeros(16, heads, dim, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    att = Heads(heads, heads, dim, dim**-0.5, (0, 1))
    backend = CpuBackend(batch_invariant=False)
    meta = backend.prepare(ps, [], [([0, 1, 2], n, n)], torch.device("cpu"))
    got = backend.forward(att, q, k, v, kc, vc, meta)
    rounded = F.scaled_dot_product_attention(q.transpose(0, 1), k.bfloat16().float().transpose(0, 1),
                                             v.bfloat16().float().transpose(0, 1), is_causal=True)
    exact = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    torch.testing.assert_close(got, rounded.transpose(0, 1), atol=1e-6, rtol=1e-6)
    assert float((got - exact.transpose(0, 1)).abs().max()) > 1e-4


def test_bf16_cache_writes_round_to_nearest_even():
    """The pool's rows as torch rounds them (nearest even), the kernel reading them back."""
    k = torch.tensor([[[1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-9), 3.0e38]]])  # ties both ways, and a large one
    cache = torch.zeros(4, 1, 4, dtype=torch.bfloat16)
    write_cache(k, k, cache, cache, torch.tensor([2]))
    assert cache[2, 0].tolist() == [1.0, 1.0 + 2**-6, -1.0, float(torch.tensor(3.0e38).bfloat16())]


def test_partial_attentions_merge_by_lse():
    """Each sequence's pages split between two "ranks" (one holding none for some): merging the
    partial outputs by their lse gives the whole attention."""
    heads, kv_of_q, dim, ps = 6, (0, 0, 0, 0, 1, 1), 32, 4
    lens = [3, 13, 20]
    q, kc, vc, page_lists = random_case(heads, kv_of_q, dim, ps, lens, seed=3)
    kv, scale = torch.tensor(kv_of_q), dim**-0.5
    whole = cpu_kernel.paged_decode(q, kc, vc, tables_of(page_lists), torch.tensor(lens), kv, ps, scale)
    outs, lses = [], []
    for part in (slice(0, 2), slice(2, None)):  # first two pages, the rest
        pages = [p[part] for p in page_lists]
        n = [max(0, min(len(p) * ps, length - (part.start * ps))) for p, length in zip(pages, lens)]
        lse = torch.empty(len(lens), heads)
        outs.append(cpu_kernel.paged_decode(q, kc, vc, tables_of(pages), torch.tensor(n), kv, ps, scale, lse=lse))
        lses.append(lse)
    lse = torch.stack(lses)  # [2, B, H]
    merged = (torch.stack(outs) * torch.exp(lse - torch.logsumexp(lse, dim=0)).unsqueeze(-1)).sum(0)
    torch.testing.assert_close(merged, whole, atol=1e-5, rtol=1e-5)


def test_backends_agree_on_a_mixed_batch():
    """Decodes and a prefill chunk with context in one step: both decode paths, same output and
    the same cache writes."""
    heads, kv_of_q, dim, ps = 6, (0, 0, 0, 1, 1, 1), 32, 8
    lens = [5, 30, 64]
    q, kc, vc, page_lists = random_case(heads, kv_of_q, dim, ps, lens + [40])
    decodes = list(zip(page_lists[:3], lens))
    prefills = [(page_lists[3], 12, 40)]
    t = len(lens) + 12
    g = torch.Generator().manual_seed(1)
    q = torch.randn(t, heads, dim, generator=g)
    k, v = torch.randn(t, 2, dim, generator=g), torch.randn(t, 2, dim, generator=g)
    att = Heads(heads, 2, dim, dim**-0.5, kv_of_q)
    outs, caches = [], []
    for backend in (TorchBackend(), CpuBackend(batch_invariant=False)):
        meta = backend.prepare(ps, decodes, prefills, torch.device("cpu"))
        kcc, vcc = kc.clone(), vc.clone()
        outs.append(backend.forward(att, q, k, v, kcc, vcc, meta))
        caches.append((kcc, vcc))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_a_compiler_failure_is_a_clear_error(tmp_path):
    with pytest.raises(cpu_kernel.KernelUnavailable, match="failed on paged_decode.c"):
        native.compile_library(["false"], cpu_kernel.SOURCE, tmp_path / "k.so")
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind


def test_a_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(cpu_kernel.KernelUnavailable, match="cannot run the C compiler '/nonexistent/cc'"):
        native.load_uncached(cpu_kernel.SOURCE)


def test_backend_choice(tiny_model):
    path, _ = tiny_model("llama")
    base = dict(model=path, show_progress=False, num_pages=64)
    assert EngineCore(EngineConfig(**base)).runner.attention.name == "cpu"
    assert EngineCore(EngineConfig(**base, attention_backend="torch")).runner.attention.name == "torch"
    with pytest.raises(ValueError, match="--attention-backend cpu needs a CPU device and float32, got cpu and fl"):
        EngineCore(EngineConfig(**base, dtype="float16", attention_backend="cpu"))
    # bfloat16 on the CPU: bfloat16 weights with float32 around them, so the C kernel attends
    assert EngineCore(EngineConfig(**base, dtype="bfloat16", attention_backend="cpu")).runner.attention.name == "cpu"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(**base, attention_backend="flash")


def test_cpu_float32_weights_are_held_once(tiny_model):
    """Float32 linear layers and the LM head become F32 rows in the C kernels' x16 layout, the
    loaded weight dropped; a tied embedding then looks its rows up in the LM head's copy; the MoE
    experts swap theirs for oneDNN's packed copy (memory does not double either way); half
    precision keeps the dense weights."""
    path, _ = tiny_model("qwen3_moe")
    model = EngineCore(EngineConfig(model=path, show_progress=False, num_pages=64)).runner.model
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.weight is None and m.packed is None and [q.name for _, q in m.quant] == ["F32x16"]
                           for m in linears)
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert moes and all(m.packed and m.w13 is None for m in moes)
    assert model.lm_head.quant.name == "F32x16" and model.lm_head.weight is None
    if model.cfg.tie_word_embeddings:  # one copy for both
        assert model.embed_tokens.quant is model.lm_head.quant and model.embed_tokens.weight is None
    half = EngineCore(EngineConfig(model=path, show_progress=False, num_pages=64, dtype="float16")).runner.model
    assert all(m.packed is None and m.weight is not None for m in half.modules() if isinstance(m, PackedLinear))
    # bfloat16: every matrix as BF16 rows in the x16 layout (the experts too), nothing else kept
    bf = EngineCore(EngineConfig(model=path, show_progress=False, num_pages=64, dtype="bfloat16")).runner.model
    linears = [m for m in bf.modules() if isinstance(m, PackedLinear)]
    assert all(m.weight is None and [q.name for _, q in m.quant] == ["BF16x16"] for m in linears)
    moes = [m for m in bf.modules() if isinstance(m, SparseMoE)]
    assert all(m.w13 is None and {q.name for pair in m.quant for segs in pair for _, q in segs} == {"BF16x16"}
               for m in moes)
    assert bf.lm_head.quant.name == "BF16x16" and bf.lm_head.weight is None

