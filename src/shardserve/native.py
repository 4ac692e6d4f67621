"""Build and load the project's C kernels: compiled once per machine, loaded with ctypes.

Each kernel is one C file (which may include its neighbours) compiled with the system C
compiler on first use (a few seconds) into a cache keyed by the sources, the build commands,
the compiler and the CPU (it is compiled with -march=native, so a cache copied to another CPU
is rebuilt, not crashed). The kernels include no torch headers; they link torch's bundled
OpenMP runtime so their threads are torch's. Where no compiler works, `load_library` raises
KernelUnavailable saying why, and the caller keeps its torch path; the first such failure logs
one warning naming every library that falls back, what runs instead, and what that costs.
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
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# An undeclared function is an error, as GCC 14 and clang 16 make it by default: an older
# compiler here must not build what a newer one elsewhere refuses.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11",
         "-Werror=implicit-function-declaration"]


class KernelUnavailable(RuntimeError):
    """A kernel could not be built or loaded here; the message says why."""


@dataclass(frozen=True)
class Library:
    """One compiled library: its C file and what the engine does without it."""

    name: str
    source: Path
    provides: str
    fallback: str


_PACKAGE = Path(__file__).parent
SHARED = _PACKAGE / "csrc"  # headers several libraries include (amx.h: whether this process runs AMX; bf16.h)
LIBRARIES = (
    Library("layers", _PACKAGE / "layers" / "csrc" / "decode_loop.c",
            "quantized GGUF products, the decode loop, fused CPU ops",
            "quantized GGUF products run dequantized in torch (several times slower, weights expanded to float32), "
            "the decode loop and the fused CPU ops (RMSNorm, rotary, SiLU) run as torch modules (slower decode)"),
    Library("attention", _PACKAGE / "attention" / "csrc" / "paged_decode.c", "paged decode attention",
            "paged decode attention runs as torch's gather + SDPA (slower decode, more so at long contexts)"),
)


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def cache_root() -> Path:
    """Where shardserve keeps what it builds once per machine: $SHARDSERVE_CACHE, else
    $XDG_CACHE_HOME/shardserve (~/.cache/shardserve)."""
    return Path(os.environ.get("SHARDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "shardserve"))


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _torch_openmp() -> str | None:
    """torch's own OpenMP runtime, where the wheel bundles one. Linking a kernel against that
    file makes it share torch's thread pool; a second runtime would spin beside the first."""
    import torch

    libs = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    return libs[0] if libs else None


def _commands(cc: list[str], source: Path, obj: str, out: str) -> list[list[str]]:
    omp = _torch_openmp()
    link = [omp, f"-Wl,-rpath,{os.path.dirname(omp)}"] if omp else ["-fopenmp"]
    return [[*cc, *FLAGS, f"-I{SHARED}", "-c", str(source), "-o", obj],
            [*cc, "-shared", obj, *link, "-lm", "-o", out]]


def compile_library(cc: list[str], source: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # Several ranks may build at once: each writes its own files, the rename is atomic.
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, lib = os.path.join(tmp, "k.o"), os.path.join(tmp, "k.so")
        for cmd in _commands(cc, source, obj, lib):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                why = proc.stderr.strip()[-500:] or f"exit status {proc.returncode}"
                raise KernelUnavailable(f"{cc[0]} failed on {source.name}: {why}")
        os.replace(lib, out)


def library(name: str) -> ctypes.CDLL:
    """The library of LIBRARIES named `name`; raises KernelUnavailable (see load_library)."""
    return load_library(next(lib.source for lib in LIBRARIES if lib.name == name))


def load_library(source: Path) -> ctypes.CDLL:
    """The compiled library of one C file (built on first use); raises KernelUnavailable, after
    the process's one warning about what falls back."""
    lib = _attempt(source)
    if isinstance(lib, KernelUnavailable):
        warn_fallbacks()
        raise KernelUnavailable(str(lib))  # a fresh exception: the cached one would grow tracebacks
    return lib


@functools.cache
def _attempt(source: Path) -> ctypes.CDLL | KernelUnavailable:
    try:
        lib = load_uncached(source)
    except KernelUnavailable as e:
        return e
    log.info("C kernels from %s: %s", source.name, kernel_paths(lib))
    return lib


def declare(lib: ctypes.CDLL, signatures: dict[str, tuple[list, object]],
            optional: frozenset[str] = frozenset()) -> ctypes.CDLL:
    """The library with each function's C signature, name: (argument types, result type; None for
    void), declared; a name in `optional` may be absent (a function some CPUs' builds leave out).
    Also for a build made for another CPU, in the tests."""
    for name, (args, res) in signatures.items():
        if name in optional and not hasattr(lib, name):
            continue
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def kernel_paths(lib: ctypes.CDLL) -> str:
    """What the library says its build runs on (its `kernel_paths()`): chosen once, when it was
    compiled for this CPU."""
    fn = lib.kernel_paths
    fn.argtypes, fn.restype = [], ctypes.c_char_p
    return fn().decode()


@functools.cache
def warn_fallbacks() -> None:
    """Logs, once per process and in one line, each library that cannot be had here with what
    runs instead; silent where all load."""
    failed = [(lib, str(why)) for lib in LIBRARIES if isinstance(why := _attempt(lib.source), KernelUnavailable)]
    if not failed:
        return
    reasons = {why for _, why in failed}
    if len(reasons) == 1:
        text = f"C kernels unavailable ({reasons.pop()}): " + "; ".join(lib.fallback for lib, _ in failed)
    else:
        text = "C kernels unavailable: " + "; ".join(f"{lib.fallback} ({why})" for lib, why in failed)
    log.warning("%s", " ".join(text.split()))  # one line, even for a compiler's multi-line error


def compiler() -> list[str]:
    """The C compiler command: $CC (may carry flags), else cc or gcc on PATH; [""] for none."""
    return shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]


def library_path(source: Path) -> Path:
    """Where the cache holds (or will hold) the library of `source` for this compiler and CPU;
    raises KernelUnavailable where no compiler runs."""
    if not source.is_file():
        raise KernelUnavailable(f"{source} is missing (an install without the package's csrc files)")
    cc = compiler()
    if not cc[0]:
        raise KernelUnavailable("no C compiler (cc/gcc) on PATH")
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        # A source may #include its neighbours and the shared headers: all of them are part of the key.
        texts = [f.read_text() for d in (source.parent, SHARED) for f in sorted(d.glob("*.[ch]"))]
        parts = [source.name, *texts, repr(_commands(cc, source, "", "")), version, _cpu_signature()]
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"cannot run the C compiler {cc[0]!r}: {e}") from e
    digest = hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]
    return cache_dir() / f"{source.stem}-{digest}.so"


def load_uncached(source: Path) -> ctypes.CDLL:
    """Builds (where the cache lacks it) and loads the library of `source`, without warning."""
    path, cc = library_path(source), compiler()
    if not path.exists():
        log.info("building the C kernel %s into %s", source.name, path)
        try:
            compile_library(cc, source, path)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelUnavailable(f"cannot build {source.name}: {e}") from e
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"cannot load {path}: {e}") from e
