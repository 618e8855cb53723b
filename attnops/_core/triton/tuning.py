"""Timing a launch's tuning candidates where it runs (``python -m attnops gpu-report --tune``): inside
:func:`session`, the first launch of each (family, kernel, shape bucket) runs every candidate
(:func:`.tuned.candidates`) from the same inputs, checks that each writes what the default writes (within the
dtype's tolerance; integers and booleans exactly) and spills no more registers than the default, and times it
(CUDA events, the median of the repeats; the wall clock through the interpreter). The launch then leaves the
default's results, so the operator's output is unchanged. Each result becomes one entry of the tuned table."""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field

import torch

from . import tuned

INTERPRETED_CANDIDATES = 2  # the interpreter ignores warps and stages: the default and one variant try the flow
TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 2e-2, torch.float32: 1e-3, torch.float64: 1e-6}


@dataclass
class Session:
    """Tuning results by (family, kernel, bucket); no new bucket starts after ``deadline`` (``time.monotonic``)."""

    repeats: int
    deadline: float
    entries: dict = field(default_factory=dict)

    def measure(self, family, launch, configs: list, device: torch.device, interpret: bool) -> None:
        """Run ``launch`` with each candidate and record the fastest verified one; the default's results stay."""
        key = (family.name, launch.kernel, tuned.bucket(launch, configs))
        if key in self.entries or time.monotonic() > self.deadline:
            family.launch_with(launch, configs[0], interpret)
            return
        tensors = [a for a in launch.args if isinstance(a, torch.Tensor)]
        before = [t.clone() for t in tensors]
        default_kernel = family.launch_with(launch, configs[0], interpret)
        reference = [t.clone() for t in tensors]
        default_spills = _spills(default_kernel)
        timings = []
        for config in tuned.candidates(configs)[:INTERPRETED_CANDIDATES if interpret else None]:
            timings.append(dict(config=tuned.signature(config),
                                **self._time(family, launch, config, interpret, device, tensors, before, reference,
                                             default_spills)))
        for t, r in zip(tensors, reference):
            t.copy_(r)
        verified = [t for t in timings if t["status"] == "ok"]
        if not verified:
            return
        best = min(verified, key=lambda t: t["median_ms"])
        self.entries[key] = dict(family=key[0], kernel=key[1], bucket=key[2], chosen=best["config"],
                                 default=timings[0]["config"], speedup=round(timings[0]["median_ms"] /
                                                                             best["median_ms"], 3),
                                 timings=timings)

    def _time(self, family, launch, config, interpret: bool, device: torch.device, tensors: list, before: list,
              reference: list, default_spills: int) -> dict:
        """``status`` (ok / compile error / spills / differs) and, when ok, ``median_ms`` over ``repeats``."""
        _restore(tensors, before)
        try:
            kernel = family.launch_with(launch, config, interpret)
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile is recorded, not fatal
            return dict(status=f"error: {type(e).__name__}: {e}"[:200])
        spills = _spills(kernel)
        if spills > default_spills:
            return dict(status=f"spills {spills} words")
        if not all(_matches(t, r) for t, r in zip(tensors, reference)):
            return dict(status="differs from the default")
        times = []
        for _ in range(self.repeats):
            _restore(tensors, before)
            times.append(_timed(lambda: family.launch_with(launch, config, interpret), device))
        return dict(status="ok", median_ms=round(statistics.median(times), 5), spills=spills)


def _restore(tensors: list, saved: list) -> None:
    for t, s in zip(tensors, saved):
        t.copy_(s)


def _spills(kernel) -> int:
    """Spilled words of a compiled kernel (0 through the interpreter, which compiles nothing)."""
    return int(getattr(kernel, "n_spills", 0) or 0)


def _matches(result: torch.Tensor, reference: torch.Tensor) -> bool:
    if not (result.is_floating_point() or result.is_complex()):
        return torch.equal(result, reference)
    tol = TOLERANCE.get(result.dtype, 1e-3)
    return torch.allclose(result.float(), reference.float(), rtol=tol, atol=tol, equal_nan=True)


def _timed(run, device: torch.device) -> float:
    """Milliseconds of one ``run()``: CUDA events on a GPU, the wall clock on the CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        run()
        return 1e3 * (time.perf_counter() - start)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


_ACTIVE: list[Session] = []


def active() -> Session | None:
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def session(repeats: int, seconds: float):
    """Tune the launches run inside (the first of each bucket) for at most ``seconds``."""
    tuning = Session(repeats, time.monotonic() + seconds)
    _ACTIVE.append(tuning)
    try:
        yield tuning
    finally:
        _ACTIVE.pop()
