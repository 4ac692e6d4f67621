"""The CPU decode-attention kernel (csrc/paged_decode.c): compiled once per machine, loaded with ctypes.

Decode attention dominates a CPU decode step when done with torch ops: every layer gathers each
sequence's pages into a padded tensor and SDPA reads that copy again. The C kernel reads K/V in
place from the pages. It is built with the system C compiler on first use (about a second) into
a cache keyed by the source, the compiler and the CPU (it is compiled with -march=native), and
links no torch headers. Where no compiler works, `load()` says why and the engine keeps the
torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


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


def _compile(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # Several ranks may build at once: each writes its own file, the rename is atomic.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise KernelUnavailable(f"{cc} failed on {SOURCE.name}: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load() -> ctypes.CDLL:
    """The compiled kernel library; raises KernelUnavailable with the reason."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KernelUnavailable("no C compiler (cc/gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_signature()]).encode())
    path = _cache_dir() / f"paged_decode-{key.hexdigest()[:16]}.so"
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
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float,
                   ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, kv_of_q: torch.Tensor, page_size: int, scale: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, H, D] (rows may be strided); caches [slots, Hkv, D]; block_tables [B, P] and
    context_lens [B] int64; kv_of_q [H] int64. Writes and returns out [B, H, D] (contiguous)."""
    b, h, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.is_contiguous()
    if out is None:
        out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    assert out.is_contiguous() and out.shape == (b, h, d)
    rc = load().paged_decode_f32(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], context_lens.data_ptr(), kv_of_q.data_ptr(), out.data_ptr(),
        b, h, k_cache.shape[1], d, page_size, scale, torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged_decode: out of memory for attention scores")
    return out
