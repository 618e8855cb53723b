"""Small C++ CPU kernels, compiled on first use with the system C++ compiler and loaded with :mod:`ctypes`.

The sources ship in this package. The first call finds the shared library in the cache or builds it, for the CPU
it runs on (``-march=native``; ``ATTNOPS_CPU_ARCH`` names another target): :mod:`.build` says where, under which
key, and how concurrent and interrupted builds are handled; ``python -m attnops build-kernels`` builds it ahead of
time. The kernels take raw pointers and strides and need no PyTorch headers (a build takes a few seconds);
:mod:`ctypes` releases the GIL for a call. The tables they read are laid out as :mod:`.layout` says, and a library
whose own description of them (``attnops_row_layout``) differs is refused.

The decode kernel has two Python entries: :func:`decode_chunks` (FIA decode) runs a table of
:func:`.layout.chunk_row` rows, and :func:`paged_attention` (the NSA decode operators) a whole call whose chunks the
library builds from the block table; either with no Python work per chunk, on the calling thread and
``torch.get_num_threads() - 1`` workers at most: PyTorch's own OpenMP threads where PyTorch runs on GNU OpenMP (as
:func:`attnops._core.parallel.run_jobs` does: they spin for milliseconds after every PyTorch operator, and other
workers would share the CPUs with them), else the library's own threads (``threads.h``), which sleep while they
wait. A call also leaves out the workers for which no CPU is free at its start (one that shares a CPU with another
process gains nothing and can hold up the call, see ``threads.h``), and a small call runs on the calling thread
alone; ``ATTNOPS_CPU_DYNAMIC_THREADS=0`` makes every call use all of them.

Without a compiler, when the build fails or the library is refused, or with ``ATTNOPS_CPU_KERNELS=0``,
:func:`library` returns None once (with a warning naming the reason when a build was tried) and callers run the
pure-PyTorch path; :func:`status` says which, :func:`location` where the library is.
"""
from __future__ import annotations

import ctypes
import os
import threading
import warnings
from pathlib import Path

import torch

from ...._core import parallel
from ...._core.errors import PerformanceWarning
from . import build, layout

_lock = threading.Lock()
# "lib": the loaded library or None, "why": the reason it is None; with a library: "path", "built" (by this
# process), "recipe" (build.Recipe)
_state: dict = {}


class LayoutMismatch(RuntimeError):
    """The library's row layout is not :mod:`.layout`'s."""


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, i32 = ctypes.c_void_p, ctypes.c_int
    lib.attnops_decode_chunks_parallel.argtypes = [p, i32, i32, i32]
    lib.attnops_decode_chunks_parallel.restype = i32
    lib.attnops_paged_attention.argtypes, lib.attnops_paged_attention.restype = [p, i32, i32], i32
    lib.attnops_workers_with_a_cpu.argtypes, lib.attnops_workers_with_a_cpu.restype = [i32], i32
    lib.attnops_use_openmp_team.argtypes, lib.attnops_use_openmp_team.restype = [p], None
    lib.attnops_decode_tile_scores.argtypes, lib.attnops_decode_tile_scores.restype = [], i32
    lib.attnops_use_openmp_team(parallel.openmp_parallel_entry())
    describe = getattr(lib, "attnops_row_layout", None)
    if describe is None:
        raise LayoutMismatch(f"{path} does not describe its row layout (no attnops_row_layout)")
    describe.argtypes, describe.restype = [], ctypes.c_char_p
    problem = layout.mismatch(describe().decode())
    if problem is not None:
        raise LayoutMismatch(f"{path}: {problem}")
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use, or None (see the module docstring)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state.update(_open())
    return _state["lib"]


def open_library() -> dict:
    """Find or build the library and load it (:data:`_state`'s entries with a library). Raises
    :class:`build.BuildError` or :class:`LayoutMismatch`."""
    recipe = build.recipe(openmp=False)  # its own threads (see the module docstring)
    path, built = build.find_or_build(recipe)
    return {"lib": _load(path), "why": None, "path": path, "built": built, "recipe": recipe}


def _open() -> dict:
    if os.environ.get("ATTNOPS_CPU_KERNELS", "1") == "0":
        return {"lib": None, "why": "disabled by ATTNOPS_CPU_KERNELS=0"}
    try:
        return open_library()
    except build.NoCompiler as e:
        return {"lib": None, "why": str(e)}
    except Exception as e:  # any build or load failure: the PyTorch path serves every call
        what = "refused" if isinstance(e, LayoutMismatch) else "build failed"
        warnings.warn(f"attnops: the CPU decode kernel could not be built or loaded ({e}); the pure-PyTorch path "
                      "runs instead", PerformanceWarning, stacklevel=3)
        return {"lib": None, "why": f"{what}: {e}"}


def status() -> str:
    """Which CPU decode path runs: the compiled kernel (and its workers), or the PyTorch path and why."""
    lib = library()
    if lib is None:
        return f"pure PyTorch ({_state['why']})"
    workers = "threads of its own" if parallel.openmp_parallel_entry() is None else "PyTorch's OpenMP threads"
    return f"compiled C++ kernel on {workers}"


def location() -> str | None:
    """Where the loaded library is and what it was built for (None: no library)."""
    if library() is None:
        return None
    recipe = _state["recipe"]
    return f"{_state['path']} (CPU {recipe.cpu}; {recipe.compiler})"


def tile_scores() -> bool:
    """Whether the kernel takes bf16 keys' scores on the AMX tile unit in this process (where the CPU has AMX-BF16
    and Linux grants it; ``ATTNOPS_CPU_AMX=0`` keeps them on fp32 FMAs): callers then pass the bf16 query before
    scaling (:func:`.layout.query_fields`)."""
    if "tile_scores" not in _state:
        lib = library()
        _state["tile_scores"] = lib is not None and lib.attnops_decode_tile_scores() == 1
    return _state["tile_scores"]


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


def _threads() -> tuple[int, int]:
    """The threads a kernel call may use and whether it picks fewer by itself (see the module docstring)."""
    return parallel.job_threads(torch.device("cpu")), int(os.environ.get("ATTNOPS_CPU_DYNAMIC_THREADS", "1") != "0")


def decode_chunks(rows: list[list[int]]) -> None:
    """The chunks of :func:`.layout.chunk_row` ``rows`` on every thread jobs may use (:func:`parallel.job_threads`),
    in one kernel call, fewer where CPUs are busy (see the module docstring). Every tensor the rows point into must
    stay alive during the call; a chunk's result does not depend on the threads that compute it."""
    table = torch.tensor(rows, dtype=layout.DTYPE)
    code = library().attnops_decode_chunks_parallel(table.data_ptr(), len(rows), *_threads())
    if code:
        raise RuntimeError(f"attnops_decode_chunks_parallel returned {code}")


PAGE_OUTSIDE_CACHE = -2  # paged_attention's code: compressed keys in a block outside the cache (nothing written)


def paged_attention(call: list[int]) -> int:
    """One NSA decode call (a :func:`.layout.paged_call`) in one kernel call on the threads :func:`decode_chunks`
    uses: the normalised output (0 for a head without keys) and probabilities. Returns 0, or
    :data:`PAGE_OUTSIDE_CACHE` for compressed attention over keys partly outside the cache (nothing written). Every
    tensor the call points into must stay alive during it."""
    fields = (ctypes.c_int64 * len(call))(*call)
    code = library().attnops_paged_attention(fields, *_threads())
    if code not in (0, PAGE_OUTSIDE_CACHE):
        raise RuntimeError(f"attnops_paged_attention returned {code}")
    return code
