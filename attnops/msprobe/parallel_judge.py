"""Units of calls judged side by side in worker processes (``python -m attnops compare --jobs N``).

Each worker is a fresh (spawned) process that loads the dump directories it is given once and judges whole
units (a call number's forward and backward together). The re-runs are multi-threaded themselves: the workers
share the caller's intra-op threads, ``torch.get_num_threads() // N`` each (at least 1), so N workers together
use the cores one judging process would. The caller receives the results as units finish and puts them back in
dump order.
"""
from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch

from .dump import DumpDir, load_dump
from .judge import CallResult, judge_unit

__all__ = ["judge_units", "worker_threads"]

_dumps: dict[str, DumpDir] = {}  # the dump directories this worker has loaded


def worker_threads(jobs: int) -> int:
    """Intra-op threads of each of ``jobs`` workers: the caller's share."""
    return max(1, torch.get_num_threads() // jobs)


def _start_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def _judge(path: str, names: list[str]) -> list[CallResult]:
    if path not in _dumps:
        _dumps[path] = load_dump(Path(path))
    return list(judge_unit(_dumps[path], names))


def judge_units(work: list[tuple[DumpDir, list[str]]], jobs: int,
                collect: Callable[[DumpDir, list[str], list[CallResult]], None]) -> None:
    """Judge each ``(dump, entry names)`` unit of ``work`` on ``jobs`` worker processes; ``collect(dump, names,
    results)`` receives each unit's results as it finishes. A worker's error is raised here."""
    context = multiprocessing.get_context("spawn")  # a forked child would inherit the parent's OpenMP threads
    with ProcessPoolExecutor(min(jobs, len(work)), mp_context=context, initializer=_start_worker,
                             initargs=(worker_threads(jobs),)) as pool:
        pending = {pool.submit(_judge, str(dump.path), names): (dump, names) for dump, names in work}
        for future in as_completed(pending):
            dump, names = pending[future]
            collect(dump, names, future.result())
