"""Progress lines of the command line (on stderr, so stdout keeps only results):
``[3/12] case  elapsed 40s, ETA 2m10s``."""
from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO


def format_duration(seconds: float) -> str:
    """``7s``, ``2m05s``, ``1h03m`` (rounded to the second)."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_line(step: int, total: int, label: str, elapsed: float, eta: float | None) -> str:
    """``[step/total] label  elapsed ..`` plus ``, ETA ..`` once there is an estimate."""
    line = f"[{step}/{total}] {label}  elapsed {format_duration(elapsed)}"
    return line if eta is None else f"{line}, ETA {format_duration(eta)}"


class Progress:
    """Announces each step of a known list of steps with the elapsed time and an ETA that extrapolates the time of
    the finished steps by their ``weights`` (e.g. FLOPs; equal by default). ``overwrite`` redraws one line
    (terminals) instead of writing one line per step."""

    def __init__(self, weights: Sequence[float], stream: TextIO | None = None, overwrite: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.weights = [float(w) for w in weights]
        self.stream = sys.stderr if stream is None else stream
        self.overwrite = overwrite
        self.clock = clock
        self.start = clock()
        self.step = 0
        self._width = 0

    def eta(self) -> float | None:
        """Seconds left after the steps done so far (None before the first one is done)."""
        done = sum(self.weights[:self.step])
        if done <= 0:
            return None
        return (self.clock() - self.start) * sum(self.weights[self.step:]) / done

    def next(self, label: str) -> None:
        """Announce the next step (``label``)."""
        line = progress_line(self.step + 1, len(self.weights), label, self.clock() - self.start, self.eta())
        self.step += 1
        self._write(line)

    def finish(self, summary: str | None = None) -> None:
        """Erase a redrawn line; then write ``summary in <total time>`` when ``summary`` is given."""
        if self.overwrite and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        if summary is not None:
            self.stream.write(f"{summary} in {format_duration(self.clock() - self.start)}\n")
        self.stream.flush()

    def _write(self, line: str) -> None:
        if self.overwrite:
            line = line[:max(20, shutil.get_terminal_size().columns - 1)]  # a wrapped line cannot be redrawn
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
