"""Argument helpers shared by the torch_npu-compatible functions (no attention math)."""
from __future__ import annotations

from typing import Any, Callable

INT_MAX = 2147483647


def reject_unsupported(**arguments: Any) -> None:
    """Raise :class:`NotImplementedError` naming the first argument that is given (not None) but not supported."""
    for name, value in arguments.items():
        if value is not None:
            raise NotImplementedError(
                f"{name}: attnops.torch_npu does not support this argument yet (expected None, got "
                f"{type(value).__name__}); see docs/porting.md")


def with_overloads(fn: Callable, out: Callable | None = None) -> Callable:
    """``fn`` with the ``.default`` (and ``.out``) overload attributes that ``torch.ops.npu.<op>`` packets have,
    recorded as one call by a ``torch.npu.NPUGraph`` capture (:func:`.npu_graph.recorded`)."""
    from .npu_graph import recorded

    op = recorded(fn)
    op.default = op
    if out is not None:
        op.out = op if out is fn else recorded(out)
    return op
