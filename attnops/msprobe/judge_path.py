"""Judging a dump path (``python -m attnops compare``): every rank directory's calls, one unit after another or,
with ``jobs`` > 1, units side by side in worker processes (``--jobs N``).

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

from .dump import DumpDir, find_dump_dirs, load_dump
from .judge import CallResult, entries_of, judge_unit, units

__all__ = ["judge_path", "worker_threads"]

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


def _judge_units(work: list[tuple[DumpDir, list[str]]], jobs: int,
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


def judge_path(path: str | Path, *, step: int | None = None, rank: int | None = None, api: str | None = None,
               jobs: int = 1, on_result: Callable[[CallResult, int, int], None] | None = None) -> list[CallResult]:
    """:func:`~.judge.judge_dump` over every rank directory under ``path`` (dump root, step or rank directory),
    in dump order. ``jobs`` > 1 judges that many units (:func:`~.judge.units`) at once in worker processes;
    ``on_result(result, done, total)`` is called as each call's result arrives (in completion order: call by call,
    or unit by unit from the workers)."""
    dumps = [load_dump(d) for d in find_dump_dirs(path, step=step, rank=rank)]
    entries = [(dump, entries_of(dump, api)) for dump in dumps]
    total = sum(len(es) for _, es in entries)
    work = [(dump, names) for dump, es in entries for names in units(es)]
    done: dict[tuple[str, str], CallResult] = {}

    def collect(dump: DumpDir, names: list[str], results: list[CallResult]) -> None:
        for n, r in zip(names, results):
            done[str(dump.path), n] = r
            if on_result is not None:
                on_result(r, len(done), total)

    if jobs > 1 and len(work) > 1:
        _judge_units(work, jobs, collect)
    else:
        for dump, names in work:
            for name, result in zip(names, judge_unit(dump, names)):
                collect(dump, [name], [result])
    return [done[str(dump.path), e.name] for dump, es in entries for e in es]
