"""Work memory of the references: a clear attnops error naming the argument and the tensors when a call's outputs
and statistics cannot be allocated (instead of the allocator's generic error, or a run that swaps for minutes).

Inputs can be far smaller than the outputs they imply (an ``expand``-ed query has stride 0), so the sizes are
estimated before anything is allocated."""
from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence

import torch

from .checks import fail


def _physical_memory_bytes() -> int | None:
    """The machine's physical memory, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


PHYSICAL_MEMORY = _physical_memory_bytes()  # read once (also a constant for torch.compile)


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


@contextlib.contextmanager
def work_memory(name: str, got, device: torch.device,
                tensors: dict[str, tuple[Sequence[int], torch.dtype]]) -> Iterator[None]:
    """Context around the allocation of ``tensors`` (name -> (shape, dtype)) on ``device``: refuses upfront what
    exceeds the CPU's physical memory, and turns an allocator failure inside into the same attnops error, which
    names the argument ``name`` (received: ``got``) and the tensors' sizes."""
    sizes = {t: math.prod(shape) * dtype.itemsize for t, (shape, dtype) in tensors.items()}
    listed = ", ".join(f"{t} {list(tensors[t][0])} {tensors[t][1]} ({_gib(n)})" for t, n in sizes.items())
    expected = f"sizes whose outputs fit in memory on {device} (needs {_gib(sum(sizes.values()))}: {listed}"
    limit = PHYSICAL_MEMORY if device.type == "cpu" else None
    if limit is not None and sum(sizes.values()) > limit:
        fail(name, f"{expected}; this machine has {_gib(limit)})", got)
    try:
        yield
    except (MemoryError, RuntimeError) as e:  # torch: "DefaultCPUAllocator: can't allocate memory", CUDA OOM
        if isinstance(e, RuntimeError) and "alloc" not in str(e).lower() and "out of memory" not in str(e).lower():
            raise
        fail(name, f"{expected}; the allocation failed: {str(e).splitlines()[0]})", got)
