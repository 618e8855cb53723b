"""The state of :func:`attnops.testing.gpu_dry_run`: while it is on, dispatch takes the Triton path for tensors on
any device (``meta`` included) as it would on a GPU, and :meth:`KernelFamily.run` records each launch here instead
of running it. Pure Python: nothing here imports Triton."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field


class HostSyncError(RuntimeError):
    """The Triton path read a device tensor's values on the host, made a blocking upload or passed a kernel a tensor
    on another device, inside :func:`attnops.testing.gpu_dry_run`: on a GPU this would synchronise the stream (or
    fail) and break CUDA-graph capture."""


@dataclass(frozen=True)
class LaunchRecord:
    """One launch the Triton path would have made: the family and kernel, the program grid under the chosen tile
    configuration, every constexpr (tiles included) and the warps/stages."""

    family: str
    kernel: str
    grid: tuple[int, ...]
    constexprs: dict
    num_warps: int
    num_stages: int


@dataclass
class DryRun:
    """An active dry run: the launches recorded so far, and the guard against host reads (a context manager
    factory). A custom op's implementation runs below the dispatcher's Python modes, so its ``meta`` kernel enters
    the guard again (:mod:`attnops._core.custom_ops`)."""

    guard: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    launches: list[LaunchRecord] = field(default_factory=list)

    @property
    def checks_host_reads(self) -> bool:
        return self.guard is not contextlib.nullcontext


_ACTIVE: list[DryRun] = []  # a stack: dry runs may nest (the innermost records)


def active() -> DryRun | None:
    """The innermost active dry run, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def push(guard: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> DryRun:
    run = DryRun(guard)
    _ACTIVE.append(run)
    return run


def pop(run: DryRun) -> None:
    if not _ACTIVE or _ACTIVE[-1] is not run:
        raise RuntimeError("gpu_dry_run contexts must be exited in the reverse order of entry")
    _ACTIVE.pop()
