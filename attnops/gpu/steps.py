"""The steps of ``gpu-report`` and their run under one time budget.

Each step is a child process in its own process group with an expected time (``expected_s``, what the budget plans
with) and a cap (``cap_s``, where a hanging step is killed). :func:`run_within_budget` runs the steps in their
order and stops starting new ones once the time left cannot fit the next one's expected time; a running step is
killed when the budget runs out. SIGTERM, SIGINT and SIGHUP stop the run the same way (the running step is killed,
the rest recorded as skipped), so the caller can always write what it has."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

PENDING = "pending"
DONE = "done"
FAILED = "failed"
TIMEOUT = "timeout"  # killed at its own cap
KILLED_BUDGET = "killed (budget)"  # killed when the whole run's budget ran out
SKIPPED_BUDGET = "skipped (budget)"
INTERRUPTED = "interrupted"  # running when the run was stopped by a signal
SKIPPED_INTERRUPT = "skipped (interrupted)"
FAILURES = (FAILED, TIMEOUT)  # the statuses that make gpu-report exit 1


@dataclass
class Step:
    name: str
    command: list[str]
    expected_s: float  # planning estimate
    cap_s: float  # kill the step after this long
    env: dict = field(default_factory=dict)
    cwd: Path | None = None
    status: str = PENDING
    seconds: float = 0.0
    tail: str = ""
    log: Path | None = None


class Interrupted(Exception):
    """The run was stopped by a signal (``signum``)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signal.Signals(signum).name}")
        self.signum = signum


@contextmanager
def stop_on_signals():
    """Turn SIGTERM, SIGINT and SIGHUP into :class:`Interrupted` inside the block (in the main thread; elsewhere,
    where Python cannot install handlers, the signals keep their handlers)."""
    def handler(signum, _frame):
        raise Interrupted(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = [signal.SIGTERM, signal.SIGINT] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run_step(step: Step, log_path: Path, env: dict, limit_s: float | None = None) -> Step:
    """Run ``step.command`` in its own process group, output to ``log_path``, for at most ``limit_s`` (default
    ``step.cap_s``); on timeout or :class:`Interrupted` kill the whole group (pytest workers, NCCL children). The
    status is ``done``, ``failed``, ``timeout`` (the limit was the step's cap) or ``killed (budget)``."""
    limit = step.cap_s if limit_s is None else min(limit_s, step.cap_s)
    step.log = log_path
    print(f"== {step.name} (expected {step.expected_s:.0f} s, limit {limit:.0f} s): {' '.join(step.command)}",
          flush=True)
    start = time.perf_counter()
    proc = None
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(step.command, cwd=step.cwd, env=dict(env, **step.env), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            rc = proc.wait(timeout=limit)
            step.status = DONE if rc == 0 else FAILED
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        step.status = TIMEOUT if limit >= step.cap_s else KILLED_BUDGET
    except Interrupted:
        _kill_group(proc)
        step.status = INTERRUPTED
        raise
    finally:
        step.seconds = time.perf_counter() - start
        step.tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:]) if log_path.exists() else ""
        if step.status != DONE:
            print(step.tail, flush=True)
        print(f"== {step.name}: {step.status} in {step.seconds:.1f} s", flush=True)
    return step


def _kill_group(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_within_budget(steps: list[Step], deadline: float, log_path: Callable[[Step], Path], env: dict,
                      progress: Callable[[], None]) -> None:
    """Run the pending ``steps`` in order until ``deadline`` (``time.perf_counter()`` seconds): a step whose
    expected time no longer fits, and every step after it, is ``skipped (budget)``; ``progress()`` runs after
    each step. On :class:`Interrupted` the steps not run are ``skipped (interrupted)`` and it re-raises."""
    out_of_time = False
    try:
        for step in steps:
            if step.status != PENDING:
                continue
            left = deadline - time.perf_counter()
            out_of_time = out_of_time or step.expected_s > left
            if out_of_time:
                step.status = SKIPPED_BUDGET
                print(f"== {step.name}: {SKIPPED_BUDGET} (expected {step.expected_s:.0f} s, {max(left, 0):.0f} s "
                      "left)", flush=True)
                continue
            run_step(step, log_path(step), env, limit_s=left)
            out_of_time = step.status == KILLED_BUDGET
            progress()
    except Interrupted:
        for step in steps:
            if step.status == PENDING:
                step.status = SKIPPED_INTERRUPT
        raise
