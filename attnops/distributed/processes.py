"""One spawned process per rank, joined with a deadline: how the check and the tests run multi-process cases."""
from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence


def run_ranks(target: Callable, world: int, args: Sequence, timeout_s: float
              ) -> tuple[list[multiprocessing.Process], list[int]]:
    """Run ``target(rank, *args)`` in ``world`` spawned processes and join each within ``timeout_s``; processes
    still running then are killed. Returns the processes (for their exit codes) and the pids that had to be killed.
    Raises what starting a process raises."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(rank, *args), daemon=True) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return procs, hung
