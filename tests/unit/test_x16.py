"""The x16 layout and its products (layers/csrc/quant_x16.c), for Q4_0, Q4_1, Q8_0, float32 and
bfloat16 rows: the bytes regroup and come back, the products match the reference to the 16-bit
activations (bfloat16: to bfloat16 activations where AMX or vdpbf16ps run them), every row of a
batch is bit for bit the row computed alone, and builds for other CPUs (AVX2 with and without
AVX-VNNI, AVX-512 without VNNI, no AMX, no AVX512-BF16) give the same bits as this machine's
(bfloat16 with float32 activations: the bits of the float32 product of the same weights)."""

from __future__ import annotations

import ctypes
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from shardserve import native
from shardserve.layers import kernels, quant_kernel
from shardserve.loader.quantized import BF16, F32, QuantWeight, bf16_rows, deinterleave16, float_rows, interleave16

FORMATS = [2, 3, 8, F32, BF16]  # Q4_0, Q4_1, Q8_0, F32, BF16


def weight(qtype: int, rows: int, cols: int, seed: int = 0) -> QuantWeight:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    if qtype == F32:
        return float_rows(w)
    if qtype == BF16:
        return bf16_rows(w)
    return QuantWeight(qtype, torch.from_numpy(quantize(w.numpy(), T(qtype)).reshape(rows, -1)), cols)


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("rows", [5, 16, 37])
def test_layout_round_trip(qtype: int, rows: int) -> None:
    q = weight(qtype, rows, 96)
    x = interleave16(q)
    assert x.name == q.name + "x16" and x.nbytes == q.nbytes
    assert not torch.equal(x.data, q.data)
    assert torch.equal(deinterleave16(x).data, q.data)
    assert torch.equal(x.dequantize(), q.dequantize())
    with pytest.raises(ValueError, match="interleaved weight is not cut"):
        x.narrow(0, 0, 1)


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("rows", [37, 160])  # a part-filled last group; whole groups
def test_every_row_alone_equals_it_in_the_batch(qtype: int, rows: int) -> None:
    q = weight(qtype, rows, 128)
    x16 = quant_kernel.kernel_layout(q)
    assert x16.name == q.name + "x16"
    xs = torch.randn(40, 128, generator=torch.Generator().manual_seed(1))
    batch = quant_kernel.linear(xs, ((0, x16),), rows)
    bf16_acts = qtype == BF16 and quant_kernel.bf16_activations()  # AMX or vdpbf16ps round them
    want = (xs.bfloat16().float() if bf16_acts else xs) @ q.dequantize().T
    tol = 1e-5 if qtype in (F32, BF16) else 2e-4  # float products; or the blocks' 16-bit activations
    assert float((batch - want).abs().max()) <= tol * float(want.abs().max())
    for m in (1, 2, 3, 8, 9, 13, 17):
        for i in (0, 40 - m):
            assert torch.equal(quant_kernel.linear(xs[i: i + m], ((0, x16),), rows), batch[i: i + m]), (m, i)


@pytest.mark.parametrize("qtype", FORMATS)
def test_a_prefill_chunk_in_row_blocks_equals_its_rows_alone(qtype: int) -> None:
    """The kernels take many activation rows in blocks (ROW_BLOCK, quant_matmul.c): a row's bits
    do not depend on which block it falls in, nor on the rows before it."""
    q = quant_kernel.kernel_layout(weight(qtype, 37, 128, seed=3))
    xs = torch.randn(600, 128, generator=torch.Generator().manual_seed(4))
    batch = quant_kernel.linear(xs, ((0, q),), 37)
    for i, m in ((0, 1), (250, 20), (255, 2), (123, 300), (511, 89), (599, 1)):
        assert torch.equal(quant_kernel.linear(xs[i: i + m], ((0, q),), 37), batch[i: i + m]), (i, m)


@pytest.mark.parametrize("qtype", FORMATS)
def test_embedding_rows_are_the_native_rows(qtype: int) -> None:
    q = weight(qtype, 37, 64)
    ids = torch.tensor([0, 15, 16, 31, 32, 36, 5])
    assert torch.equal(quant_kernel.dequantize(interleave16(q), ids), quant_kernel.dequantize(q, ids))


NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16"]
OTHER_CPUS = [
    (["-mno-avx512f"], "avx2"),  # with AVX-VNNI where this CPU has it
    (["-mno-avx512f", "-mno-avxvnni"], "avx2 (vpmaddwd ymm)"),
    (["-mno-avx512vnni"], "(vpmaddwd"),  # AVX-512 without VNNI (or AVX2 on an AVX2-only host)
    (["-mno-avx"], "scalar"),  # no vector unit at all: plain C
]
# Every build this module's tests ask for (a build takes seconds): started together on first use,
# two at a time (gcc runs in its own process), each built once and shared.
BUILDS = [flags for flags, _ in OTHER_CPUS] + [["-mno-amx-int8"], [*NO_AMX, "-mno-avx512bf16"], [], ["-O1"],
                                                ["-Os"], NO_AMX]
_built: dict[tuple[str, ...], Future] = {}
_where: list[Path] = []


def _build(out: Path, flags: list[str]) -> Path:
    source = next(lib.source for lib in native.LIBRARIES if lib.name == "layers")
    native.compile_library([*native.compiler(), *flags], source, out)
    return out


def built(flags: list[str]) -> Path:
    """The layers' library compiled as for a CPU without the ISA extensions `flags` turn off."""
    if not _built:
        _where.append(Path(tempfile.mkdtemp(prefix="x16_builds_")))
        pool = ThreadPoolExecutor(2)
        for i, f in enumerate(BUILDS):
            _built[tuple(f)] = pool.submit(_build, _where[0] / f"layers{i}.so", f)
        pool.shutdown(wait=False)  # the builds go on; each test awaits its own
    return _built[tuple(flags)].result()


@pytest.fixture(scope="module", autouse=True)
def _builds_removed():
    yield
    for future in _built.values():
        future.cancel() or future.exception()  # each build finished (or never started) before its folder goes
    for where in _where:
        shutil.rmtree(where, ignore_errors=True)
    _built.clear()
    _where.clear()


def build_for(tmp_path: Path, flags: list[str], fresh: bool = False) -> ctypes.CDLL:
    """That library loaded; `fresh`: a copy of it, so that its load-time choices (environment
    variables) are made again."""
    path = built(flags)
    if fresh:
        path = Path(shutil.copy(path, tmp_path / "fresh.so"))
    return kernels.bind(ctypes.CDLL(str(path)))


def bf16_path(lib: ctypes.CDLL) -> str:
    """How that library runs bfloat16 products (quant_kernel.bf16_path's names)."""
    lib.bf16_path.restype = ctypes.c_int
    return quant_kernel.BF16_PATHS[lib.bf16_path()]


def product(lib: ctypes.CDLL, w: QuantWeight, x: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.rows)
    rc = lib.qmatmul(w.qtype, w.data.data_ptr(), w.data.stride(0), w.rows, w.cols, x.data_ptr(), x.shape[0],
                     x.stride(0), y.data_ptr(), y.stride(0), 2)
    assert rc == 0
    return y


@pytest.mark.parametrize("flags, path", OTHER_CPUS)
def test_other_cpus_builds_give_the_same_bits(tmp_path: Path, flags: list[str], path: str) -> None:
    here, other = kernels.load(), build_for(tmp_path, flags)
    assert path in native.kernel_paths(other)
    # the sampler's logit passes (logit_rows.c) are AVX-512 builds' only
    assert hasattr(other, "rows_argmax") == ("-mno-avx512f" not in flags and "-mno-avx" not in flags)
    for rows in (11, 40):
        xs = torch.randn(rows, 192, generator=torch.Generator().manual_seed(2))
        xs[0, :32] = 0.0
        xs[0, 5] = 1e-36  # a block whose step would be subnormal: quantized to zero on every build
        for qtype in FORMATS:
            w = interleave16(weight(qtype, 45, 192, seed=qtype))
            if qtype == BF16 and bf16_path(other) == "float32 activations":
                same = interleave16(float_rows(w.dequantize()))  # the float32 product of the same weights
                assert torch.equal(product(other, w, xs), product(here, same, xs)), rows
                continue
            if qtype == BF16 and bf16_path(other) != bf16_path(here):
                continue  # AMX here, vdpbf16ps there: each sums in its own order (tested below)
            assert torch.equal(product(other, w, xs), product(here, w, xs)), (qtype, rows)


AMX_INT8 = "amx-int8 tiles"  # where kernel_paths says the block formats' products take them


@pytest.mark.skipif("amx_int8" not in Path("/proc/cpuinfo").read_text().split(), reason="the CPU lacks AMX-INT8")
def test_amx_int8_products_are_the_x16_bits(tmp_path: Path) -> None:
    """From 16 activation rows the block formats' products run on AMX-INT8 tiles (quant_amx_i8.c),
    with the numbers of the vector path that every row count takes in a build without them: bit
    for bit, at a part-filled tile of rows (17, 40), at many rows (300: even shares, and at 4096
    columns a panel is 144 weight rows, so a share spans two), on one thread or two, at a part-
    filled last group of weight rows (230) and a weight of fewer rows than a tile (5)."""
    here, other = kernels.load(), build_for(tmp_path, ["-mno-amx-int8"])
    if AMX_INT8 not in native.kernel_paths(here):
        pytest.skip(f"AMX-INT8 is not used here: {native.kernel_paths(here)}")
    assert AMX_INT8 not in native.kernel_paths(other)
    for qtype in (2, 3, 8):
        for rows, cols in ((230, 4096), (5, 96)):
            w = interleave16(weight(qtype, rows, cols, seed=qtype))
            xs = torch.randn(300, cols, generator=torch.Generator().manual_seed(qtype))
            xs[4, :32] = 0.0  # a block of zeros: step 0
            for m in (17, 40, 300):
                for threads in (1, 2):
                    got, want = torch.empty(m, rows), torch.empty(m, rows)
                    for lib, y in ((here, got), (other, want)):
                        assert lib.qmatmul(w.qtype, w.data.data_ptr(), w.data.stride(0), w.rows, w.cols,
                                           xs.data_ptr(), m, xs.stride(0), y.data_ptr(), y.stride(0), threads) == 0
                    assert torch.equal(got, want), (qtype, rows, m, threads)


@pytest.mark.parametrize("cols", [200, 60])  # a last part-filled chunk of 32 columns; not whole vectors of 8
def test_bf16_without_amx_or_avx512bf16_is_the_float32_product(tmp_path: Path, cols: int) -> None:
    """A build without AMX and AVX512-BF16 (or a CPU that refuses AMX and lacks the other) says so
    and runs bfloat16 weights against float32 activations: bit for bit the float32 product of the
    same weights."""
    other = build_for(tmp_path, [*NO_AMX, "-mno-avx512bf16"])
    assert "bfloat16: x16 groups, float32 activations" in native.kernel_paths(other)
    w = interleave16(weight(BF16, 45, cols, seed=3))
    for rows in (1, 11, 40):
        xs = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        want = xs.double() @ w.dequantize().double().T  # float32 rounding of the exact sums
        got = product(other, w, xs)
        assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max()), rows
        if cols % 8 == 0:  # the F32 rows' kernel takes whole vectors: bit for bit its product
            same = interleave16(float_rows(w.dequantize()))
            assert torch.equal(got, product(kernels.load(), same, xs)), rows


def test_float32_activations_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SHARDSERVE_FLOAT32_ACTIVATIONS=1, read when the library loads: bfloat16 weights against
    float32 activations whatever the CPU offers, the float32 product of the same weights."""
    monkeypatch.setenv("SHARDSERVE_FLOAT32_ACTIVATIONS", "1")
    other = build_for(tmp_path, [], fresh=True)
    assert bf16_path(other) == "float32 activations"
    assert "bfloat16: x16 groups, float32 activations" in native.kernel_paths(other)
    w = interleave16(weight(BF16, 45, 192, seed=7))
    xs = torch.randn(9, 192, generator=torch.Generator().manual_seed(7))
    assert torch.equal(product(other, w, xs), product(kernels.load(), interleave16(float_rows(w.dequantize())), xs))


@pytest.mark.skipif(quant_kernel.bf16_path() != "amx", reason="bfloat16 runs on AMX only where the CPU has it")
@pytest.mark.parametrize("opt", ["-O1", "-Os"])
def test_amx_at_other_optimization_levels(tmp_path: Path, opt: str) -> None:
    """The tile configuration must reach the tiles whole at any optimization level (a local
    struct's stores could be dropped at -O1, and the probe would then turn AMX off); the same bits."""
    other = build_for(tmp_path, [opt])
    assert bf16_path(other) == "amx"
    w = interleave16(weight(BF16, 45, 200, seed=6))
    xs = torch.randn(17, 200, generator=torch.Generator().manual_seed(6))
    assert torch.equal(product(other, w, xs), product(kernels.load(), w, xs))
    if AMX_INT8 in native.kernel_paths(kernels.load()):  # the block formats' tiles too
        assert AMX_INT8 in native.kernel_paths(other)
        xs = xs[:, :192]
        for qtype in (2, 3, 8):
            w = interleave16(weight(qtype, 45, 192, seed=qtype))
            assert torch.equal(product(other, w, xs), product(kernels.load(), w, xs)), qtype


def bf16_library(path: str, tmp_path: Path) -> ctypes.CDLL:
    """The library whose bfloat16 products take `path`: this machine's for AMX, a build without
    AMX for vdpbf16ps (an AMX CPU has AVX512-BF16 too); skips where the CPU offers neither."""
    if path == "amx":
        if quant_kernel.bf16_path() != "amx":
            pytest.skip("bfloat16 runs on AMX only where the CPU has it")
        return kernels.load()
    if "avx512_bf16" not in Path("/proc/cpuinfo").read_text().split():
        pytest.skip("the CPU lacks AVX512-BF16")
    lib = build_for(tmp_path, NO_AMX)
    assert "bfloat16: x16 groups on avx512-bf16 vdpbf16ps" in native.kernel_paths(lib)
    return lib


@pytest.mark.parametrize("path", ["amx", "avx512-bf16"])
@pytest.mark.parametrize("cols", [64, 200, 576, 60])  # whole chunks of 32 columns; a part-filled last one
def test_bf16_activation_paths_rows_alone_equal_the_batch(tmp_path: Path, path: str, cols: int) -> None:
    """AMX tiles (16 activation rows at a time) and vdpbf16ps (up to 8 rows by 2 groups, or 4 by
    4): each output is its own row's, alone or in any batch, and equals the float64 product of
    the bfloat16-rounded operands to float32 rounding."""
    lib = bf16_library(path, tmp_path)
    assert bf16_path(lib) == path
    w = interleave16(weight(BF16, 70, cols, seed=4))  # 70: 4 whole groups and a part-filled one
    xs = torch.randn(40, cols, generator=torch.Generator().manual_seed(5))
    batch = product(lib, w, xs)
    want = xs.bfloat16().double() @ w.dequantize().double().T
    assert float((batch.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    for m in (1, 2, 3, 5, 8, 9, 15, 16, 17, 31, 33):
        for i in (0, 40 - m):
            assert torch.equal(product(lib, w, xs[i: i + m]), batch[i: i + m]), (m, i)
    bad = xs.clone()
    bad[3, 7] = float("nan")  # rounding to bfloat16 keeps a NaN a NaN: its row says so, no other row changes
    got = product(lib, w, bad)
    assert bool(got[3].isnan().all()) and torch.equal(got[torch.arange(40) != 3], batch[torch.arange(40) != 3])


@pytest.mark.parametrize("qtype", [BF16, F32])
@pytest.mark.parametrize("cols", [4096, 4112])  # panels of 96 (AMX) or 64 (float32) weight rows
def test_many_rows_take_panels_and_even_shares(qtype: int, cols: int) -> None:
    """From 256 activation rows each thread takes an even share of the weight rows and passes all
    the activation rows over it panel by panel (amx_rows, f32x16_rows; at this many columns a
    panel is 96 or 64 weight rows, so a share spans two). Each output is still its own row's: bit
    for bit the row alone (guided claims), on one thread or two, and the float64 product (of the
    bfloat16-rounded activations on AMX) to float32 rounding."""
    if qtype == BF16 and quant_kernel.bf16_path() != "amx":
        pytest.skip("bfloat16 runs on AMX only where the CPU has it")
    if qtype == F32 and cols % 32:
        pytest.skip("one column count is enough for float32")
    lib = kernels.load()
    w = interleave16(weight(qtype, 230, cols, seed=8))  # 14 whole groups and a part-filled one
    xs = torch.randn(300, cols, generator=torch.Generator().manual_seed(8))  # a part-filled last tile of rows
    want = (xs.bfloat16().double() if qtype == BF16 else xs.double()) @ w.dequantize().double().T
    for threads in (1, 2):
        y = torch.empty(300, 230)
        assert lib.qmatmul(w.qtype, w.data.data_ptr(), w.data.stride(0), w.rows, w.cols, xs.data_ptr(), 300,
                           xs.stride(0), y.data_ptr(), y.stride(0), threads) == 0
        assert float((y.double() - want).abs().max()) <= 1e-5 * float(want.abs().max()), threads
        for i in (0, 17, 150, 299):
            assert torch.equal(product(lib, w, xs[i: i + 1]), y[i: i + 1]), (threads, i)
        if qtype == BF16 and cols % 32 == 0:  # bfloat16 rows handed in (qmatmul_bf16): the same bits
            assert torch.equal(quant_kernel.linear(xs.bfloat16(), ((0, w),), 230), y), threads
