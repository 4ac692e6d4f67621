"""The attention library as other CPUs build it: each machine compiles it for its own CPU
(-march=native), so a build for a CPU without AVX-512, or without AVX512-BF16, or without AMX,
must compile and take its own path. Here those builds are made by turning extensions off."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
from test_cpu_fast_paths import random_case, reference

from shardserve import native
from shardserve.attention import cpu_kernel
from shardserve.attention.metadata import build_metadata

CPU_FLAGS = set(Path("/proc/cpuinfo").read_text().split())


@pytest.mark.parametrize("flags, path, bf16, needs", [
    (["-mno-avx512f"], "float32 KV cache only", False, "avx512f"),  # an AVX2-only CPU (an AMD EPYC, say)
    (["-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16"], "float32 KV cache only", False, "avx512f"),
    (["-mno-amx-tile", "-mno-amx-bf16"], "vdpbf16ps", True, "avx512_bf16"),  # AVX512-BF16 without AMX
])
def test_the_attention_library_builds_for_other_cpus(tmp_path, flags, path, bf16, needs):
    """It builds (an AVX2-only build once referred to the AMX path's switch, which only AVX512-BF16
    builds defined), says which path it took, and its float32 kernel agrees with the reference."""
    if needs not in CPU_FLAGS:
        pytest.skip(f"the CPU lacks {needs}: its own build is this one")
    if not native.compiler()[0]:
        pytest.skip("no C compiler here")
    out = tmp_path / "attention.so"
    native.compile_library([*native.compiler(), *flags], cpu_kernel.SOURCE, out)
    lib = cpu_kernel.bind(ctypes.CDLL(str(out)))
    assert path in native.kernel_paths(lib)
    assert hasattr(lib, "paged_decode_bf16") == bf16
    kv_of_q, page_size = (0, 0, 0, 1, 1, 1, 2, 2, 2), 16
    lens = [1, 17, 37, 200]
    q, kc, vc, page_lists = random_case(9, kv_of_q, 64, page_size, lens)
    meta = build_metadata(page_size, list(zip(page_lists, lens)), [], torch.device("cpu"), paged_decode=True)
    tables, ctx, kv = meta.paged.block_tables, meta.paged.context_lens, torch.tensor(kv_of_q)
    got = torch.empty_like(q)
    assert lib.paged_decode_f32(q.data_ptr(), q.stride(0), kc.data_ptr(), vc.data_ptr(), tables.data_ptr(),
                                tables.shape[1], ctx.data_ptr(), None, kv.data_ptr(), got.data_ptr(), None, len(lens),
                                9, 3, 64, page_size, 0.125, 0.0, 2) == 0
    torch.testing.assert_close(got, reference(q, kc, vc, tables, ctx, kv, page_size, 0.125), atol=1e-5, rtol=1e-5)
