"""The CPU decode-attention kernel (csrc/paged_decode.c): compiled once per machine, loaded with ctypes.

Decode attention dominates a CPU decode step when done with torch ops: every layer gathers each
sequence's pages into a padded tensor and SDPA reads that copy again. The C kernel reads K/V in
place from the pages. It is built with the system C compiler on first use (about a second) into
a cache keyed by the source, the build commands, the compiler and the CPU (it is compiled with
-march=native). It includes no torch headers; it links torch's bundled OpenMP runtime so its
threads are torch's. Where no compiler works, `load()` says why and the engine keeps the torch
path.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]


class KernelUnavailable(RuntimeError):
    """The kernel could not be built or loaded here; the message says why."""


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _cache_dir() -> Path:
    root = os.environ.get("SHARDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "shardserve")
    return Path(root) / "kernels"


def _torch_openmp() -> str | None:
    """torch's own OpenMP runtime, where the wheel bundles one. Linking the kernel against that
    file makes it share torch's thread pool; a second runtime would spin beside the first."""
    libs = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    return libs[0] if libs else None


def _commands(cc: list[str], obj: str, out: str) -> list[list[str]]:
    omp = _torch_openmp()
    link = [omp, f"-Wl,-rpath,{os.path.dirname(omp)}"] if omp else ["-fopenmp"]
    return [[*cc, *FLAGS, "-c", str(SOURCE), "-o", obj], [*cc, "-shared", obj, *link, "-lm", "-o", out]]


def _compile(cc: list[str], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # Several ranks may build at once: each writes its own files, the rename is atomic.
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, lib = os.path.join(tmp, "k.o"), os.path.join(tmp, "k.so")
        for cmd in _commands(cc, obj, lib):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise KernelUnavailable(f"{cc[0]} failed on {SOURCE.name}: {proc.stderr.strip()[-500:]}")
        os.replace(lib, out)


@functools.cache
def load() -> ctypes.CDLL:
    """The compiled kernel library; raises KernelUnavailable with the reason."""
    cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not cc[0]:
        raise KernelUnavailable("no C compiler (cc/gcc) on PATH")
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        parts = [SOURCE.read_text(), repr(_commands(cc, "", "")), version, _cpu_signature()]
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"cannot run the C compiler {cc[0]!r}: {e}") from e
    path = _cache_dir() / f"paged_decode-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]}.so"
    if not path.exists():
        log.info("building the CPU decode-attention kernel into %s", path)
        try:
            _compile(cc, path)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelUnavailable(f"cannot build {SOURCE.name}: {e}") from e
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"cannot load {path}: {e}") from e
    fn = lib.paged_decode_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float,
                   ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, kv_of_q: torch.Tensor, page_size: int, scale: float,
                 out: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, H, D] (rows may be strided); caches [slots, Hkv, D]; block_tables [B, P] and
    context_lens [B] int64 (0 allowed: zero out rows); kv_of_q [H] int64. Writes and returns
    out [B, H, D] (contiguous). With `lse` (contiguous float32 [B, H]) also writes each row's
    log(sum_t exp(scale * q . k_t)), -inf for an empty context, for merging partial attentions
    over disjoint key sets: out = sum_i out_i * exp(lse_i - logsumexp_i(lse_i))."""
    b, h, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.is_contiguous()
    if out is None:
        out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    assert out.is_contiguous() and out.shape == (b, h, d)
    if lse is not None:
        assert lse.is_contiguous() and lse.dtype == torch.float32 and lse.shape == (b, h)
    rc = load().paged_decode_f32(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], context_lens.data_ptr(), kv_of_q.data_ptr(), out.data_ptr(),
        None if lse is None else lse.data_ptr(), b, h, k_cache.shape[1], d, page_size, scale, torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged_decode: out of memory for attention scores")
    return out
