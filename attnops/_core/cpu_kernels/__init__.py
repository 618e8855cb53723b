"""Small C++ CPU kernels, compiled on first use with the system C++ compiler and loaded with :mod:`ctypes`.

The sources ship in this package. The first call builds a shared library into a cache directory
(``$ATTNOPS_CACHE_DIR``, default ``~/.cache/attnops``; one file per source, compiler, flags and CPU, so a rebuilt or
moved installation never loads a stale one), for the CPU it runs on (``-march=native``; ``ATTNOPS_CPU_ARCH`` names
another target) and later calls load it. The kernels take raw pointers and strides and need no PyTorch headers (a
build takes a few seconds); :mod:`ctypes` releases the GIL for a call.

:func:`decode_chunks` is the one Python entry to the decode kernel (FIA decode and the NSA decode operators): it
runs a table of :func:`chunk_row` rows, with no Python work per chunk. Where PyTorch runs on GNU OpenMP
(``libgomp``, as its Linux wheels do), the library is built with ``-fopenmp`` and binds to that same runtime, so the
chunks run on PyTorch's own OpenMP threads: the threads that PyTorch's previous operator leaves spinning take the
work at once, where Python worker threads would first compete with them for the cores (measured: 7 ms against
12 ms for a 134 MB fp16 cache right after a ``torch.sum``). Elsewhere the chunks go to
:func:`attnops._core.parallel.run_jobs` workers.

Without a compiler, when the build fails, or with ``ATTNOPS_CPU_KERNELS=0``, :func:`library` returns None once
(with a warning naming the reason when a build was tried) and callers run the pure-PyTorch path;
:func:`status` says which.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

from .. import parallel
from ..errors import PerformanceWarning

_SOURCE = Path(__file__).with_name("decode.cpp")
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}  # the K/V dtypes it reads
_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded library or None, "why": the reason it is None, "openmp": built with OpenMP


def _cpu_tag() -> str:
    """The CPU's model and flags (``-march=native`` code is only loaded on the CPU it was built for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def cache_dir() -> Path:
    return Path(os.environ.get("ATTNOPS_CACHE_DIR") or Path.home() / ".cache" / "attnops")


def _flags(openmp: bool) -> tuple[str, ...]:
    """The compiler flags: ``_FLAGS``, ``-march=$ATTNOPS_CPU_ARCH`` (default ``native``: AVX-512 or AVX2 where the
    CPU has them) and, with ``openmp``, ``-fopenmp``."""
    return _FLAGS + (f"-march={os.environ.get('ATTNOPS_CPU_ARCH') or 'native'}",) + (("-fopenmp",) if openmp else ())


def _torch_uses_gomp() -> bool:
    """Whether the process has GNU OpenMP loaded (PyTorch's runtime on Linux): a library built with ``-fopenmp``
    then binds to that copy (same soname, ``libgomp.so.1``) instead of loading a second runtime."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return any(Path(line.split()[-1]).name.startswith("libgomp") for line in maps.splitlines() if "/" in line)


def _build(compiler: str, openmp: bool) -> Path:
    source = _SOURCE.read_bytes()
    flags = _flags(openmp)
    key = hashlib.sha256(source + " ".join((compiler,) + flags).encode() + _cpu_tag().encode()).hexdigest()[:16]
    target = cache_dir() / f"attnops_cpu_decode_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run([compiler, *flags, str(_SOURCE), "-o", str(out)], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(out, target)  # atomic: a concurrent build of the same key writes the same file
    return target


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, i32 = ctypes.c_void_p, ctypes.c_int
    lib.attnops_decode_chunks.argtypes = [p, i32]
    lib.attnops_decode_chunks.restype = i32
    lib.attnops_decode_chunks_parallel.argtypes = [p, i32, i32]
    lib.attnops_decode_chunks_parallel.restype = i32
    lib.attnops_openmp.argtypes = []
    lib.attnops_openmp.restype = i32
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use, or None (see the module docstring)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state.update(_open())
    return _state["lib"]


def _open() -> dict:
    if os.environ.get("ATTNOPS_CPU_KERNELS", "1") == "0":
        return {"lib": None, "why": "disabled by ATTNOPS_CPU_KERNELS=0"}
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        return {"lib": None, "why": "no C++ compiler found (set CXX, or install g++)"}
    try:
        try:
            lib = _load(_build(compiler, _torch_uses_gomp()))
        except Exception:
            if not _torch_uses_gomp():
                raise
            lib = _load(_build(compiler, False))  # a compiler without OpenMP: the Python workers run the chunks
        return {"lib": lib, "why": None, "openmp": bool(lib.attnops_openmp())}
    except Exception as e:  # any build or load failure: the PyTorch path serves every call
        warnings.warn(f"attnops: the CPU decode kernel could not be built ({e}); the pure-PyTorch path runs instead",
                      PerformanceWarning, stacklevel=3)
        return {"lib": None, "why": f"build failed: {e}"}


def status() -> str:
    """Which CPU decode path runs: the compiled kernel (and its threads), or the PyTorch path and why."""
    lib = library()
    if lib is None:
        return f"pure PyTorch ({_state['why']})"
    return "compiled C++ kernel" + (" on PyTorch's OpenMP threads" if _state["openmp"] else "")


def unavailable(device: torch.device, rounding) -> str | None:
    """Why no call on ``device`` can run on the kernel now, whatever the operator (None: it can): no built
    library, ``torch.compile`` tracing, tensors off the CPU, or an NPU rounding (``precision="npu"``)."""
    if library() is None:
        return "the CPU decode kernel is not available"
    if torch.compiler.is_compiling():
        return "torch.compile traces the PyTorch path"
    if device.type != "cpu":
        return "tensors not on the CPU"
    if rounding is not None:
        return "precision=\"npu\" (the NPU's rounding of P runs on the PyTorch path)"
    return None


def chunk_row(q: Tensor, runs: tuple[int, int], tokens: int, dtypes: tuple[torch.dtype, torch.dtype], dv: int,
              outputs: tuple[int, int, int], probabilities: int = 0) -> list[int]:
    """One row of a :func:`decode_chunks` table: a chunk of ``tokens`` keys and values (``runs``: the address and
    count of its int64 ``[n, 20]`` run descriptors, ``Run`` in ``decode.cpp``; ``dtypes``: of the keys and of the
    values) for the scaled fp32 query ``q [heads, rows, D]`` (contiguous), whose row max ``m [heads, rows]``, row sum
    ``l`` of ``exp(s - m)`` and un-normalised output ``[heads, rows, dv]`` go to the contiguous fp32 memory at the
    ``outputs`` addresses, and ``exp(s - m) [heads, rows, tokens]`` to the address ``probabilities`` (0: not
    kept)."""
    heads, rows, d = q.shape
    return [q.data_ptr(), heads, rows, d, dv, DTYPE_CODES[dtypes[0]], DTYPE_CODES[dtypes[1]], *runs, tokens,
            *outputs, probabilities]


def decode_chunks(rows: list[list[int]]) -> None:
    """The chunks of :func:`chunk_row` ``rows`` on every thread jobs may use (:func:`parallel.job_threads`): one call
    on PyTorch's OpenMP threads, or one kernel call per :func:`parallel.run_jobs` worker on a share of consecutive
    rows (see the module docstring). Every tensor the rows point into must stay alive during the call; a chunk's
    result does not depend on the thread that computes it."""
    lib, threads = library(), parallel.job_threads(torch.device("cpu"))
    table = torch.tensor(rows, dtype=torch.int64)
    if _state["openmp"] or threads == 1:
        codes = [lib.attnops_decode_chunks_parallel(table.data_ptr(), len(rows), threads)]
    else:
        bounds = [len(rows) * i // threads for i in range(threads + 1)]
        codes = []
        parallel.run_jobs(lambda i: codes.append(lib.attnops_decode_chunks(
            table[bounds[i]:].data_ptr(), bounds[i + 1] - bounds[i])), range(threads), torch.device("cpu"))
    if any(codes):
        raise RuntimeError(f"attnops_decode_chunks returned {max(codes, key=abs)}")
