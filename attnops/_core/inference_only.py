"""Inference-only operators under autograd: called with inputs that require grad, they return their outputs as usual,
with a ``grad_fn`` (graphs stay traceable), and a backward through those outputs raises
:class:`~attnops._core.errors.InferenceOnlyError` naming the training operator to use instead.

Custom ops get that autograd formula from :func:`register_inference_only`; Python paths that are not one custom op
run their forward through :func:`run_inference_only`. Both raise from the ``attnops::inference_only_backward`` op,
so ``torch.compile`` traces a backward (the op's fake kernel) and the error comes only when a backward runs.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from .errors import InferenceOnlyError
from .torch_compat import tree_leaves


@dataclass(frozen=True)
class InferenceOnly:
    """An inference-only operator: its names and the training operators to use instead (Pythonic and torch_npu)."""

    name: str
    torch_npu: str
    training: str
    torch_npu_training: str

    def message(self) -> str:
        return (f"{self.name} (torch_npu: {self.torch_npu}) is inference-only: it has no backward. For training use "
                f"{self.training} (torch_npu: {self.torch_npu_training})")


@torch.library.custom_op("attnops::inference_only_backward", mutates_args=())
def inference_only_backward(grad: Tensor, shape: Sequence[int], dtype: torch.dtype, message: str) -> Tensor:
    """The gradient of an inference-only operator's input ``[shape]``: raises ``InferenceOnlyError(message)``."""
    raise InferenceOnlyError(message)


@inference_only_backward.register_fake
def _(grad, shape, dtype, message):
    return grad.new_empty(shape, dtype=dtype)


def _input_meta(inputs: Sequence[Any]) -> list[Optional[tuple[tuple[int, ...], torch.dtype]]]:
    return [(tuple(x.shape), x.dtype) if isinstance(x, Tensor) else None for x in inputs]


def _raising_grads(ctx, record: InferenceOnly, grads: Sequence[Optional[Tensor]]) -> tuple[Optional[Tensor], ...]:
    """One gradient per input of ``ctx.meta``: the raising op for those that need one, None for the rest."""
    grad = next(g for g in grads if g is not None)
    return tuple(inference_only_backward(grad, meta[0], meta[1], record.message())
                 if meta is not None and needed else None for meta, needed in zip(ctx.meta, ctx.needs_input_grad))


def register_inference_only(op, record: InferenceOnly) -> None:
    """Give the custom op ``op`` an autograd formula whose backward raises ``record``'s error."""

    def setup_context(ctx, inputs, output):
        ctx.meta = _input_meta(inputs)

    def backward(ctx, *grads):
        return _raising_grads(ctx, record, grads)

    op.register_autograd(backward, setup_context=setup_context)


class _InferenceOnlyFunction(torch.autograd.Function):
    """``forward()``'s outputs with a grad_fn on ``inputs`` whose backward raises ``record``'s error; ``dirty`` (or
    None) is a tensor ``forward`` updates in place and returns."""

    @staticmethod
    def forward(ctx, record: InferenceOnly, forward: Callable[[], Any], dirty: Optional[Tensor], *inputs: Tensor):
        outputs = forward()
        if dirty is not None:
            ctx.mark_dirty(dirty)
        ctx.record = record
        ctx.meta = [None, None, None, *_input_meta(inputs)]  # record, forward and dirty take no gradient
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        return _raising_grads(ctx, ctx.record, grads)


def run_inference_only(record: InferenceOnly, forward: Callable[[], Any], *inputs: Any,
                       dirty: Optional[Tensor] = None) -> Any:
    """``forward()`` (a tensor or a tuple of tensors computed from ``inputs``, or ``dirty`` updated in place and
    returned); when grad mode is on and a tensor among ``inputs`` (searched through lists, tuples and dicts)
    requires grad, the result gets a grad_fn whose backward raises ``record``'s error."""
    needing = [x for x in tree_leaves(list(inputs)) if isinstance(x, Tensor) and x.requires_grad]
    if not (torch.is_grad_enabled() and needing):
        return forward()
    return _InferenceOnlyFunction.apply(record, forward, dirty, *needing)
