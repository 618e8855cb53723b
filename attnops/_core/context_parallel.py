"""How an enclosing ``torch.distributed.tensor.experimental.context_parallel()`` region reaches attnops'
FlashAttention: the region replaces ``F.scaled_dot_product_attention`` with a wrapper; while it is in place, the
FlashAttention entry points hand their calls to the runner :mod:`attnops.distributed.torch_cp` registers (ring
attention over the region's device mesh), instead of computing attention over the local shard alone."""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F

from .checks import Described, fail

_runner = None
_suspended = contextvars.ContextVar("attnops_context_parallel_suspended", default=False)


def register(runner) -> None:
    """Install the object whose ``forward(inputs)``/``backward(inputs)`` serve calls inside a region."""
    global _runner
    _runner = runner


def torch_region_active() -> bool:
    """Whether a torch ``context_parallel()`` region has replaced ``F.scaled_dot_product_attention``."""
    return "_distribute_function" in getattr(F.scaled_dot_product_attention, "__qualname__", "")


def active_runner():
    """The registered runner inside a region (None outside one, while the runner's own local calls run, and in
    code ``torch.compile`` traces: a region is an eager-mode feature)."""
    if torch.compiler.is_compiling() or not torch_region_active() or _suspended.get():
        return None
    if _runner is None:
        fail("query", "attnops.distributed imported before a call inside torch's context_parallel() (it runs the "
             "call as ring attention over the mesh)", Described("a call inside context_parallel() without it"))
    return _runner


def reject_in_region(name: str, value) -> None:
    """Raise when an option the runner cannot serve is used inside a region."""
    if active_runner() is not None:
        fail(name, "None inside torch's context_parallel()", value)


@contextlib.contextmanager
def suspended():
    """Local operator calls of the runner itself (never redirected)."""
    token = _suspended.set(True)
    try:
        yield
    finally:
        _suspended.reset(token)
