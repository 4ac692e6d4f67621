"""The sampler's C passes over a step's logits (layers/csrc/logit_rows.c): the all-finite test of
the failed-alone check and the greedy argmax, against torch's, on every kind of value. The library
is compiled with -ffast-math; the passes test bits in integers, which it cannot fold away."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest
import torch

from shardserve.layers import cpu_ops

SPECIAL = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 3.4e38, -3.4e38, 1e-45]

pytestmark = pytest.mark.skipif(cpu_ops.rows_argmax(torch.zeros(2, 2)) is None,
                                reason="the passes are built where the CPU has AVX-512 and a compiler works")


def test_random_rows_with_every_kind_of_value() -> None:
    """Widths around the 16-lane and 64-value steps, ties, NaNs, infinities, signed zeros, the
    largest floats and a subnormal: torch's argmax (the first maximum; the first NaN) and its
    all-finite test."""
    g = torch.Generator().manual_seed(1)
    for n in (1, 15, 16, 17, 63, 64, 65, 200):
        for _ in range(60):
            x = torch.randint(-3, 4, (4, n), generator=g).float()  # ties
            for r in range(4):
                for p in torch.randint(0, n, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist():
                    x[r, p] = SPECIAL[int(torch.randint(0, len(SPECIAL), (1,), generator=g))]
            assert cpu_ops.rows_argmax(x) == x.argmax(-1).tolist(), x
            assert cpu_ops.rows_finite(x).tolist() == torch.isfinite(x).all(-1).tolist(), x


def test_edge_rows() -> None:
    """Zeros of both signs as the maximum tie (the first wins), an all -inf row, a row whose only
    values above the rest are infinite, a row of NaNs; strided rows of a vocabulary."""
    x = torch.full((5, 37), -float("inf"))
    x[0, :] = -1.0
    x[0, 7], x[0, 20] = -0.0, 0.0
    x[2, 30], x[2, 36] = float("inf"), float("inf")
    x[3, 36] = float("nan")
    x[4, 3], x[4, 0] = float("nan"), -float("inf")
    assert cpu_ops.rows_argmax(x) == x.argmax(-1).tolist() == [7, 0, 30, 36, 3]
    assert cpu_ops.rows_finite(x).tolist() == [True, False, False, False, False]
    wide = torch.randn(9, 49152, generator=torch.Generator().manual_seed(2))[:, :49000]
    assert cpu_ops.rows_argmax(wide) == wide.argmax(-1).tolist() and bool(cpu_ops.rows_finite(wide).all())


def test_nothing_past_the_last_row_is_read() -> None:
    """Logits whose last row ends where readable memory ends (a page that faults follows), with
    the maximum in the last, part-filled 16 values: a read past the row would end the process."""
    page = mmap.PAGESIZE
    n = 257  # not a multiple of 16
    region = mmap.mmap(-1, 2 * page)
    guard = np.frombuffer(region, dtype=np.uint8)
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    base = guard.ctypes.data
    assert libc.mprotect(base + page, page, 0) == 0  # the second page: PROT_NONE
    try:
        floats = np.frombuffer(region, dtype=np.float32, count=page // 4)
        rows = floats[page // 4 - 2 * n:].reshape(2, n)  # two rows ending at the guard page
        rows[:] = np.arange(2 * n, dtype=np.float32).reshape(2, n) % 100
        rows[:, -1] = 1000.0
        x = torch.from_numpy(rows)
        assert cpu_ops.rows_argmax(x) == [n - 1, n - 1]
        assert cpu_ops.rows_finite(x).tolist() == [True, True]
    finally:
        libc.mprotect(base + page, page, 3)  # readable again before numpy and mmap let go of it
        del x, rows, floats, guard
        region.close()
