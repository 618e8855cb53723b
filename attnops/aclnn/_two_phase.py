"""The aclnn two-phase calling convention, implemented once for every operator.

``op_get_workspace_size(*params) -> (workspace_size, executor)`` validates the parameters (raising the
status-coded :class:`AclnnError`) and captures the call; ``op(workspace, workspace_size, executor, stream)`` runs
it and returns the outputs. ``op(*params)`` also runs directly. An executor runs once, as in aclnn.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .._core.checks import Described, fail, require


class AclnnExecutor:
    """A validated operator call, ready to run once (``aclOpExecutor``)."""

    def __init__(self, name: str, run: Callable[[], Any]):
        self.name = name
        self._run = run
        self.used = False

    def __call__(self) -> Any:
        require(not self.used, "executor", f"an unused executor of {self.name}", Described("one that already ran"),
                "request a new executor with the _get_workspace_size function")
        self.used = True
        return self._run()

    def __repr__(self) -> str:
        return f"AclnnExecutor({self.name}, used={self.used})"


def two_phase(prepare: Callable[..., Callable[[], Any]]):
    """Turn ``prepare(*params) -> run`` into the pair ``(op, op_get_workspace_size)``.

    ``prepare`` validates everything and returns a zero-argument closure computing the outputs.
    """
    name = prepare.__name__.lstrip("_")

    @functools.wraps(prepare)
    def get_workspace_size(*args, **kwargs):
        return 0, AclnnExecutor(name, prepare(*args, **kwargs))

    def op(*args, **kwargs):
        if len(args) == 4 and not kwargs and isinstance(args[2], AclnnExecutor):
            workspace, workspace_size, executor, _stream = args
            if not isinstance(workspace_size, int) or workspace_size < 0:
                fail("workspace_size", "the size returned by the _get_workspace_size function", workspace_size)
            return executor()
        return prepare(*args, **kwargs)()

    op.__name__ = op.__qualname__ = name
    op.__doc__ = prepare.__doc__
    get_workspace_size.__name__ = f"{name}_get_workspace_size"
    get_workspace_size.__qualname__ = get_workspace_size.__name__
    get_workspace_size.__doc__ = f"Phase 1 of ``{name}``: validate and return ``(workspace_size, executor)``."
    return op, get_workspace_size
