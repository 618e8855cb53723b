"""Timing and memory measurement.

CPU: ``time.perf_counter`` around each call. CUDA: CUDA events around each call, with the L2 cache flushed
(a buffer twice its size is overwritten) before every repetition, outside the timed region. Implementations of
one case are timed round-robin (one repetition of each in turn) so that a slow period of a shared machine hits
them alike; statistics are over the repetitions (min, median, mean, spread).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class L2Flusher:
    """Overwrites a buffer twice the size of the GPU's L2 cache (no-op on the CPU)."""

    def __init__(self, device: torch.device):
        self.buf = None
        if device.type == "cuda":
            size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (64 << 20)
            self.buf = torch.empty(2 * size, dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        if self.buf is not None:
            self.buf.zero_()


def time_once(fn: Callable[[], object], device: torch.device, flush: L2Flusher | None = None) -> float:
    """Seconds taken by one call of ``fn`` (the GPU work included)."""
    if device.type == "cuda":
        if flush is not None:
            flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def summarize(times: list[float]) -> dict:
    """min / median / mean / max / stdev of a list of seconds (the list included)."""
    if not times:
        return {}
    s = sorted(times)
    return {"times_s": times, "min_s": s[0], "median_s": statistics.median(s), "mean_s": statistics.fmean(s),
            "max_s": s[-1], "stdev_s": statistics.stdev(s) if len(s) > 1 else 0.0}


# ----------------------------------------------------------------------------------------- CPU load (Linux)


@contextlib.contextmanager
def busy_processes(count: int):
    """``count`` CPU-bound processes (a Python busy loop each) running until the end of the block: the load that
    the cases ``beside_load`` measure under."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.2 if procs else 0)  # running before the first timing
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()



def _cpu_times() -> tuple[int, int] | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + fields[4], sum(fields)  # idle + iowait, total


def idle_fraction(window: float = 0.25) -> float | None:
    """Fraction of the machine's CPU time that was idle over ``window`` seconds (None where unknown)."""
    a = _cpu_times()
    if a is None:
        return None
    time.sleep(window)
    b = _cpu_times()
    return (b[0] - a[0]) / max(1, b[1] - a[1])


def wait_until_idle(max_wait: float, threshold: float = 0.9, window: float = 0.25) -> float | None:
    """Wait (at most ``max_wait`` s) until the machine is idle (other processes would distort CPU timings).

    Returns the last idle fraction seen (None where unknown or when ``max_wait`` <= 0)."""
    if max_wait <= 0:
        return None
    deadline = time.monotonic() + max_wait
    frac = idle_fraction(window)
    while frac is not None and frac < threshold and time.monotonic() < deadline:
        frac = idle_fraction(window)
    return frac


# --------------------------------------------------------------------------------------------- memory


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak memory of one call: CUDA allocator peak on GPUs; on the CPU the process's peak resident set size.

    On Linux the kernel's high-water mark (VmHWM) is reset first through ``/proc/self/clear_refs``; where that is
    not allowed, a thread samples VmRSS every millisecond (may miss short peaks). ``peak_bytes`` is the peak,
    ``base_bytes`` the resident/allocated size just before the call.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.method = None
        self.base_bytes = self.peak_bytes = None
        self._stop = None
        self._samples = 0

    def __enter__(self):
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base_bytes = torch.cuda.memory_allocated(self.device)
            self.method = "torch.cuda.max_memory_allocated"
            return self
        rss = _status_kib("VmRSS")
        self.base_bytes = None if rss is None else rss * 1024
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM after clear_refs"
        except OSError:
            if rss is None:
                return self
            self.method = "VmRSS sampled every 1 ms"
            self._stop = threading.Event()
            self._peak_kib = rss

            def sample():
                while not self._stop.is_set():
                    v = _status_kib("VmRSS") or 0
                    self._peak_kib = max(self._peak_kib, v)
                    self._stop.wait(0.001)
            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        elif self.method == "VmHWM after clear_refs":
            hwm = _status_kib("VmHWM")
            self.peak_bytes = None if hwm is None else hwm * 1024
        elif self._stop is not None:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = self._peak_kib * 1024
        return False

    def as_dict(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "base_bytes": self.base_bytes, "method": self.method}


def cpu_count_used() -> int:
    return torch.get_num_threads() if hasattr(torch, "get_num_threads") else (os.cpu_count() or 1)
