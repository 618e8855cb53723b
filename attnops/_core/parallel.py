"""Independent jobs on all CPU cores: Python threads that each run PyTorch single-threaded.

Attention on the CPU is a sequence of small GEMMs and elementwise passes per (batch, head). Splitting every one of
those ops across the intra-op threads costs a fork/join per op and leaves cores idle in the serial parts; running
whole heads side by side on single-threaded workers, the way ``scaled_dot_product_attention``'s CPU kernel does
with ``at::parallel_for``, keeps every core on GEMMs. PyTorch releases the GIL inside its ops, so Python threads
give real parallelism.

The workers are PyTorch's own OpenMP threads where PyTorch runs on GNU OpenMP (its Linux wheels): :func:`run_jobs`
opens one parallel region of the OpenMP library PyTorch loaded (``GOMP_parallel``) whose threads take the jobs one
by one, the way ``at::parallel_for`` does. GNU OpenMP keeps a region's threads spinning for milliseconds after it
ends (every PyTorch operator that ran just before, a linear layer or SDPA, leaves them so); separate workers
would share the cores with those spinning threads (measured: a 6 ms causal forward took 9-11 ms right after an
SDPA call), while the same threads pick up the next region at once. Elsewhere (another OpenMP runtime, PyTorch's
native thread pool) a persistent pool of ``torch.get_num_threads()`` Python threads whose intra-op thread count is
1 serves (``torch.set_num_threads`` is per OS thread for OpenMP and MKL; the caller's setting is restored). Either
way a job's operators run single-threaded (inside a parallel region OpenMP, oneDNN and MKL run nested regions on
one thread), with autograd off and the caller's inference mode, and the first error is re-raised. With one thread,
or when called from inside a job, the jobs run one after another in the caller. So a result that each job writes
alone (callers merge shared results in a fixed order) does not depend on the thread count. Callers split their
work into enough jobs to keep the workers busy.

Around the jobs, callers run large tensor operations as jobs too (:func:`fill_`): on the fallback pool an
operation on the calling thread would run an OpenMP region whose idle threads then spin on the very cores the
workers are about to use (measured: the second worker started 2-5 ms late and its first job ran 7 ms slower).

:func:`thread_store` is the calling OS thread's dictionary for workspaces kept between calls: a ``threading.local``
would not do, since Python sees an OpenMP thread afresh at every region.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import TypeVar

import torch

T = TypeVar("T")

_state = threading.local()  # .worker: True on pool threads
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _forget_pool() -> None:
    """In a forked child: the parent's worker threads do not exist there, so the next call starts a new pool (GNU
    OpenMP's threads do not either, and it does not know: a region there waits for them forever)."""
    global _pool, _pool_size, _pool_lock
    _pool, _pool_size, _pool_lock = None, 0, threading.Lock()
    _team[:] = [None]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _init_worker(ready: threading.Barrier) -> None:
    _state.worker = True
    torch.get_num_threads()  # PyTorch's lazy per-thread init first: it would later reset the count from the global
    torch.set_num_threads(1)
    ready.wait()


def _workers(n: int) -> ThreadPoolExecutor:
    """The pool of ``n`` single-threaded workers (re-created when the caller's thread count changes)."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size != n:
            if _pool is not None:
                _pool.shutdown(wait=True)
            ready = threading.Barrier(n + 1)
            _pool = ThreadPoolExecutor(n, thread_name_prefix="attnops", initializer=_init_worker, initargs=(ready,))
            for _ in range(n):  # start every worker now, so each sets its own thread count exactly once
                _pool.submit(int)
            ready.wait()
            _pool_size = n
            torch.set_num_threads(n)  # a worker's set_num_threads(1) also changed the process-wide default
        return _pool


def job_threads(device: torch.device) -> int:
    """How many threads jobs on ``device`` run on from here: ``torch.get_num_threads()`` on the CPU (as it was
    outside :func:`serial_ops`), 1 elsewhere, inside a worker and while ``torch.compile`` traces the caller."""
    if torch.compiler.is_compiling() or device.type != "cpu" or getattr(_state, "worker", False):
        return 1
    return getattr(_state, "threads", None) or torch.get_num_threads()


def run_jobs(job: Callable[[T], None], items: Sequence[T], device: torch.device) -> None:
    """``job(item)`` for every item, on the single-threaded workers (see the module docstring); in order on the
    calling thread when :func:`job_threads` is 1."""
    threads = job_threads(device)
    if threads == 1:
        for item in items:
            job(item)
        return
    if not items:  # no region: its threads would have to arrive at its end, on a busy machine milliseconds late
        return

    inference = torch.is_inference_mode_enabled()  # grad and inference modes are per thread: carry the caller's

    def guarded(item: T) -> None:
        with torch.inference_mode(inference), torch.no_grad():
            job(item)

    team = _openmp_team()
    if team is not None:  # no more threads than jobs (one job: on the caller, its operators single-threaded)
        errors = team.run(min(threads, len(items)), guarded, items)
    else:
        errors = _run_on_pool(threads, guarded, items)
    if errors:
        raise errors[0]


def _run_on_pool(threads: int, job: Callable[[T], None], items: Sequence[T]) -> list[BaseException]:
    """The jobs on the fallback pool of Python threads; returns their errors."""
    pool = _workers(threads)
    futures = [pool.submit(job, item) for item in items]
    wait(futures)  # one wake-up when all are done (waiting on each in turn woke this thread for every job)
    return [e for e in (f.exception() for f in futures) if e is not None]


_REGION_BODY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _OpenMPTeam:
    """PyTorch's GNU OpenMP threads as the job workers: one parallel region (``GOMP_parallel``, the entry point
    compilers emit for ``#pragma omp parallel``) whose threads, the caller included, take the items in turn."""

    def __init__(self, library: ctypes.CDLL):
        self.entry = library.GOMP_parallel
        self.entry.argtypes = [_REGION_BODY, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        self.entry.restype = None

    def run(self, threads: int, job: Callable[[T], None], items: Sequence[T]) -> list[BaseException]:
        """``job(item)`` for every item on ``threads`` threads; returns the errors (the remaining items are skipped
        after the first)."""
        todo, errors = iter(items), []

        def body(_) -> None:  # on each thread of the region; a ctypes callback takes the GIL around it
            inside = getattr(_state, "worker", False)
            _state.worker = True
            torch.get_num_threads()  # PyTorch's lazy per-thread init first: it would reset the count below
            # the jobs' own regions on one thread (in a region of one thread, or with OMP_NESTED, they could run more)
            counts = [set_count(1) for set_count in _thread_setters()]
            try:
                for item in todo:  # next() runs under the GIL: each item is taken once
                    if errors:
                        break
                    try:
                        job(item)
                    except BaseException as e:  # noqa: BLE001 (re-raised by the caller; a callback cannot raise)
                        errors.append(e)
            finally:
                for set_count, count in zip(_thread_setters(), counts):
                    set_count(count)
                _state.worker = inside

        self.entry(_REGION_BODY(body), None, threads, 0)
        return errors


_team: list = []  # [the team or None], found once


def _openmp_team() -> _OpenMPTeam | None:
    """The team where PyTorch's intra-op parallelism is GNU OpenMP (``ATTNOPS_OPENMP_TEAM=0``: the Python pool),
    else None."""
    if not _team:
        library = None
        if os.environ.get("ATTNOPS_OPENMP_TEAM", "1") != "0" and "backend: OpenMP" in torch.__config__.parallel_info():
            library = next((ctypes.CDLL(path) for path in _loaded_libraries() if Path(path).name.startswith("libgomp")),
                           None)
        _team.append(_OpenMPTeam(library) if library is not None and hasattr(library, "GOMP_parallel") else None)
    return _team[0]


def openmp_parallel_entry() -> int | None:
    """The address of ``GOMP_parallel`` in the GNU OpenMP that PyTorch loaded, for compiled kernels whose workers
    should be PyTorch's OpenMP threads as well (see the module docstring), or None where jobs run on the Python
    pool."""
    team = _openmp_team()
    return None if team is None else ctypes.cast(team.entry, ctypes.c_void_p).value


_stores: dict[int, dict] = {}


def thread_store() -> dict:
    """The calling OS thread's dictionary, kept for the life of the process (see the module docstring)."""
    return _stores.setdefault(threading.get_native_id(), {})


FILL_PIECES = 8  # a fill is split into this many slices (at least FILL_GRAIN elements each)
FILL_GRAIN = 1 << 15


def fill_(fills: Sequence[tuple[torch.Tensor, float]], device: torch.device) -> None:
    """``t.fill_(value)`` for every ``(t, value)``, in slices on the workers (see the module docstring: no OpenMP
    region on the calling thread). Contiguous tensors are sliced flat, others along their longest dimension."""
    pieces = []
    for t, value in fills:
        x = t.view(-1) if t.is_contiguous() else t
        dim = max(range(x.dim()), key=lambda i: x.shape[i]) if x.dim() else 0
        size = x.shape[dim] if x.dim() else 1
        per_row = max(1, x.numel() // max(size, 1))
        step = max(-(-FILL_GRAIN // per_row), -(-size // FILL_PIECES))
        pieces += [(x.narrow(dim, i, min(step, size - i)) if x.dim() else x, value) for i in range(0, size, step)]
    run_jobs(lambda piece: piece[0].fill_(piece[1]), pieces, device)


def _loaded_libraries() -> list[str]:
    """The paths of the shared libraries loaded in this process (none where ``/proc`` is unavailable)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return list(dict.fromkeys(line.split()[-1] for line in maps.splitlines() if "/" in line))


def _thread_count_setters() -> list[Callable[[int], int]]:
    """Functions that set the calling thread's own thread count for PyTorch's parallel regions and return the one
    before: OpenMP's (GNU ``libgomp``, LLVM ``libomp`` or Intel ``libiomp5``, as loaded in this process) and MKL's
    (its vector math, ``exp`` and ``log`` on fp32 tensors, runs regions of its own), those that are loaded."""
    setters = []
    for path in _loaded_libraries():
        name = Path(path).name
        if name.startswith(("libgomp", "libomp", "libiomp")):
            omp = ctypes.CDLL(path)  # already loaded: the same copy

            def set_omp(n: int, omp=omp) -> int:
                before = omp.omp_get_max_threads()
                omp.omp_set_num_threads(n)
                return before
            setters.append(set_omp)
        elif name.startswith(("libtorch_cpu", "libmkl_rt", "libmkl_core")):
            local = getattr(ctypes.CDLL(path), "MKL_Set_Num_Threads_Local", None)  # C interface (by value)
            if local is not None:
                local.argtypes, local.restype = [ctypes.c_int], ctypes.c_int
                setters.append(local)  # returns the previous value (0: the global one)
    return setters


_setters: list = []  # [the setters], found once


def _thread_setters() -> list[Callable[[int], int]]:
    """:func:`_thread_count_setters`, found once."""
    if not _setters:
        _setters.append(_thread_count_setters())
    return _setters[0]


@contextlib.contextmanager
def serial_ops():
    """PyTorch operators that the calling thread runs inside run single-threaded (this thread's OpenMP and MKL
    thread counts are 1 until the end; other threads keep theirs); jobs (:func:`run_jobs`, the compiled kernels'
    threads) still use the thread count from before (:func:`job_threads`).

    For the host work around a compiled kernel: small tensor operations gain nothing from a parallel region, and
    GNU OpenMP keeps the region's threads spinning for milliseconds after it, on the cores that the kernel's
    threads, or other processes, need (on a busy machine a decode call on two threads then ran several times
    slower than on one)."""
    if getattr(_state, "threads", None) is not None:  # already inside
        yield
        return
    _state.threads = torch.get_num_threads()
    before = [set_count(1) for set_count in _thread_setters()]
    try:
        yield
    finally:
        for set_count, count in zip(_thread_setters(), before):
            set_count(count)
        _state.threads = None
