"""Triton kernels for paged attention: they read K/V in place from the pool through block tables.

- `paged_decode`: one query token per row over its context's pages, query heads grouped by the
  KV head they read (one K/V load serves the group), split over the context (split-KV) so a long
  context fills the device, the splits merged by log-sum-exp in a second kernel.
- `paged_extend`: prefill chunks whose K/V are already in the pool (prefix and new tokens alike),
  causal by position; a chunk with a cached prefix needs no gather and no mask.

Both return the log-sum-exp of each (row, head) too, for context parallelism's merges. The same
source runs on a GPU and, under `TRITON_INTERPRET=1`, on CPU tensors (how CI tests them), so
importing this module is left to attention/select.py, which sets the interpreter first on a CPU.

A split covers a fixed number of keys whatever the batch, so a row's splits do not depend on the
other rows (the merge's reduction width does, past two splits: bitwise invariance stops there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KEYS_PER_SPLIT = 512  # keys a decode split covers; a multiple of DECODE_BLOCK_N
DECODE_BLOCK_N = 32
EXTEND_BLOCK_M = 32
EXTEND_BLOCK_N = 32


@triton.jit
def _key_block(qv, k_cache, v_cache, stride_ks, stride_kh, stride_vs, stride_vh, table, pos, pmask, q_pos, kvh, d,
               dmask, page_size, scale, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One block of keys at positions `pos` (valid where `pmask`), read in place through the
    block table row `table`, folded into the running softmax (m_i, l_i, acc) of the queries at
    positions `q_pos` (a key is visible at or before a query's position)."""
    page = tl.load(table + pos // page_size, mask=pmask, other=0)
    slot = page.to(tl.int64) * page_size + pos % page_size  # int64: a large pool overflows int32 offsets
    kv_mask = pmask[:, None] & dmask[None, :]
    kt = tl.load(k_cache + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
    scores = tl.dot(qv, tl.trans(kt), input_precision=PRECISION) * scale  # [queries, keys]
    visible = pmask[None, :] & (pos[None, :] <= q_pos[:, None])
    scores = tl.where(visible, scores, float("-inf"))
    # A row that has seen no key yet stays at -inf; `safe` keeps exp() off -inf - -inf.
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - safe[:, None])
    alpha = tl.exp(m_i - safe)
    vt = tl.load(v_cache + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _decode_split(q, stride_qb, stride_qh, k_cache, v_cache, stride_ks, stride_kh, stride_vs, stride_vh,
                  tables, stride_tb, lens, kv_of_q, part_out, part_lse, scale, page_size, num_heads, keys_per_split,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  splits, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    b, hg, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    heads = hg * GROUP + g
    hmask = (g < GROUP) & (heads < num_heads)
    kvh = tl.load(kv_of_q + hg * GROUP)  # the group's KV head (GROUP is 1 where groups are uneven)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    qv = tl.load(q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=hmask[:, None] & dmask[None, :],
                 other=0.0)
    n = tl.load(lens + b)
    start = s * keys_per_split
    end = tl.minimum(n, start + keys_per_split)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    last = tl.zeros([BLOCK_G], tl.int64) + (n - 1)  # every key of the context is before the new token
    for k0 in range(start, end, BLOCK_N):
        pos = k0 + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = _key_block(qv, k_cache, v_cache, stride_ks, stride_kh, stride_vs, stride_vh,
                                   tables + b * stride_tb, pos, pos < end, last, kvh, d, dmask, page_size, scale,
                                   m_i, l_i, acc, PRECISION)
    empty = l_i == 0.0  # a split past the context's end: weight 0 in the merge
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    row = (b * num_heads + heads) * splits + s
    tl.store(part_out + row[:, None] * HEAD_DIM + d[None, :], o, mask=hmask[:, None] & dmask[None, :])
    tl.store(part_lse + row, lse, mask=hmask)


@triton.jit
def _merge_splits(part_out, part_lse, out, stride_ob, stride_oh, lse_out, num_heads, splits, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    base = (b * num_heads + h) * splits
    lse = tl.load(part_lse + base + s, mask=s < splits, other=float("-inf"))
    m = tl.max(lse, 0)
    safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - safe)  # 0 for empty splits; all 0 for an empty context
    total = tl.sum(w, 0)
    parts = tl.load(part_out + (base + s)[:, None] * HEAD_DIM + d[None, :],
                    mask=(s[:, None] < splits) & (d[None, :] < HEAD_DIM), other=0.0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out + b * stride_ob + h * stride_oh + d, o.to(out.dtype.element_ty), mask=d < HEAD_DIM)
    if WRITE_LSE:
        empty = total == 0.0
        lse = tl.where(empty, float("-inf"), safe + tl.log(tl.where(empty, 1.0, total)))
        tl.store(lse_out + b * num_heads + h, lse)


@triton.jit
def _extend(q, stride_qt, stride_qh, k_cache, v_cache, stride_ks, stride_kh, stride_vs, stride_vh,
            tables, stride_tc, q_starts, kv_lens, kv_of_q, out, stride_ot, stride_oh, lse_out, scale, page_size,
            num_heads, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            PRECISION: tl.constexpr, WRITE_LSE: tl.constexpr):
    c, h, mb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q0 = tl.load(q_starts + c)
    q_len = tl.load(q_starts + c + 1) - q0
    kv_len = tl.load(kv_lens + c)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < q_len
    q_pos = kv_len - q_len + rows
    kvh = tl.load(kv_of_q + h)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    qv = tl.load(q + (q0 + rows)[:, None] * stride_qt + h * stride_qh + d[None, :],
                 mask=rmask[:, None] & dmask[None, :], other=0.0)
    # Keys up to this block's last query; none for a block past the chunk's end.
    hi = tl.where(mb * BLOCK_M < q_len, tl.minimum(kv_len, kv_len - q_len + (mb + 1) * BLOCK_M), 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for k0 in range(0, hi, BLOCK_N):
        pos = k0 + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = _key_block(qv, k_cache, v_cache, stride_ks, stride_kh, stride_vs, stride_vh,
                                   tables + c * stride_tc, pos, pos < hi, q_pos, kvh, d, dmask, page_size, scale,
                                   m_i, l_i, acc, PRECISION)
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(out + (q0 + rows)[:, None] * stride_ot + h * stride_oh + d[None, :], o.to(out.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])
    if WRITE_LSE:
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        tl.store(lse_out + (q0 + rows) * num_heads + h, lse, mask=rmask)


def _precision(dtype: torch.dtype) -> str:
    # float32 must be exact float32 products (the oracle's 1e-4): tf32 is Triton's GPU default.
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, kv_of_q: torch.Tensor, group: int, page_size: int, scale: float,
                 splits: int, out: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] (head dim contiguous); caches [slots, Hkv, D]; block_tables [B, P] and
    context_lens [B] (0 allowed: a zero row, lse -inf); kv_of_q [H]; `group` from Heads.group;
    `splits` covers the longest context in KEYS_PER_SPLIT keys each. Writes out [B, H, D] and,
    where given, lse [B, H] float32."""
    b, h, d = q.shape
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    if out is None:
        out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    part_out = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    bd, prec = _block_d(d), _precision(q.dtype)
    _decode_split[(b, triton.cdiv(h, group), splits)](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), block_tables, block_tables.stride(0), context_lens, kv_of_q, part_out, part_lse, scale,
        page_size, h, KEYS_PER_SPLIT, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=d,
        BLOCK_D=bd, splits=splits, BLOCK_N=DECODE_BLOCK_N, PRECISION=prec)
    # splits is a run-time argument (no compile per context length); BLOCK_S takes powers of two.
    _merge_splits[(b, h)](part_out, part_lse, out, out.stride(0), out.stride(1), part_lse if lse is None else lse, h,
                          splits, HEAD_DIM=d, BLOCK_D=bd, BLOCK_S=max(2, triton.next_power_of_2(splits)),
                          WRITE_LSE=lse is not None)
    return out


def paged_extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 q_starts: torch.Tensor, kv_lens: torch.Tensor, kv_of_q: torch.Tensor, max_q: int, page_size: int,
                 scale: float, out: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Chunk c's queries are rows q_starts[c]..q_starts[c+1] of q [T, H, D], the last tokens of
    a context of kv_lens[c] keys already in the pool (block_tables [C, P]); each attends causally
    to the keys at or before its position. Writes those rows of out (and of lse [T, H])."""
    chunks, (_, h, d) = kv_lens.shape[0], q.shape
    if chunks == 0:
        return out
    _extend[(chunks, h, triton.cdiv(max_q, EXTEND_BLOCK_M))](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), block_tables, block_tables.stride(0), q_starts, kv_lens, kv_of_q, out, out.stride(0),
        out.stride(1), out if lse is None else lse, scale, page_size, h, HEAD_DIM=d, BLOCK_D=_block_d(d),
        BLOCK_M=EXTEND_BLOCK_M, BLOCK_N=EXTEND_BLOCK_N, PRECISION=_precision(q.dtype), WRITE_LSE=lse is not None)
    return out


def decode_splits(max_context: int) -> int:
    return max(1, triton.cdiv(max_context, KEYS_PER_SPLIT))
