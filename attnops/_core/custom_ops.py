"""What every attnops custom op shares: its ``meta`` kernel, and the eager fast path around it.

The ``meta`` kernel is the op's fake (shape-only) kernel, except inside :func:`attnops.testing.gpu_dry_run`, where
``meta`` tensors stand for GPU tensors and the op runs its real implementation (validation, dispatch, launch
planning) with the launches recorded. ``torch.compile`` and ``opcheck`` trace with FakeTensors, which always use the
fake kernel.

The eager fast path (:func:`call`): a plain eager call runs the op's implementation without the dispatcher (20-35 us
a call) and, when an input requires grad, under the op's own registered autograd formula without ``torch.library``'s
autograd wrapper (which refills the schema's defaults on every such call, some 50 us). Anything that needs to see
the op (compilation, dispatch modes, functorch, the profiler) gets the op itself (:func:`runs_directly`).
"""
from __future__ import annotations

import contextlib
import functools

import torch

from . import torch_compat
from .checks import check_same_device
from .torch_compat import custom_op_part
from .triton import dry_run


def register_dry_run_meta(op) -> None:
    """Give custom op ``op`` (a ``torch.library.custom_op`` with its fake registered) the ``meta`` kernel above."""
    implementation, fake = custom_op_part(op, "_init_fn"), custom_op_part(op, "_abstract_fn")
    if fake is None:
        raise RuntimeError(f"{custom_op_part(op, '_qualname')}: register the fake kernel before register_dry_run_meta")

    names = [a.name for a in torch_compat.schema_arguments(op)]

    def meta(*args, **kwargs):
        run = dry_run.active()
        if run is None:
            _check_one_device(dict(zip(names, args)) | kwargs)
            return fake(*args, **kwargs)
        with run.guard():
            return implementation(*args, **kwargs)

    op.register_kernel("meta", meta)


def _check_one_device(arguments: dict) -> None:
    """An eager call reaches the ``meta`` kernel when any input is on ``meta``, which is a shape-only call only if
    all its data tensors are there: a ``meta`` tensor among CPU or GPU ones is a caller's mistake. int32/int64
    tensors (lengths, tables, indices) may be host metadata on the CPU, never ``meta`` beside real data."""
    tensors = {n: t for n, t in arguments.items() if isinstance(t, torch.Tensor)}
    data = {n: t for n, t in tensors.items() if t.dtype not in (torch.int32, torch.int64)}
    if data:
        reference = next(iter(data))
        check_same_device(reference, data[reference], **data)
        if data[reference].device.type != "meta":
            check_same_device(reference, data[reference],
                              **{n: t for n, t in tensors.items() if t.device.type == "meta"})


@contextlib.contextmanager
def autograd_inside_op():
    """Record autograd graphs inside a custom op's implementation (grad mode on, the autograd dispatch keys no longer
    excluded), for an op whose backward recomputes a forward and differentiates it: the dispatcher runs an op's
    kernels below autograd, where nothing would be recorded."""
    with torch.enable_grad(), torch_compat.autograd_keys_included():
        yield


def runs_directly(tensors) -> bool:
    """Whether a call with ``tensors`` (a sequence, the first on the call's device) may run its implementation
    without the dispatcher: eager mode, plain tensors on a device the implementations serve (``meta`` only inside a
    dry run), and nothing that needs to see the op: no compilation or export, no dispatch mode (fake tensors,
    tracing, the dry run's read guard, FLOP counters), no functorch transform, no profiler."""
    return (not torch.compiler.is_compiling() and not torch_compat.dispatch_mode_active()
            and not torch.overrides.has_torch_function(tensors) and not torch_compat.functorch_transform_active()
            and not torch_compat.profiler_enabled()
            and (tensors[0].device.type in ("cpu", "cuda") or dry_run.active() is not None))


def call(op, *args):
    """``op(*args)`` (positional arguments in schema order, the first a tensor on the call's device), through the
    eager fast path when :func:`runs_directly`: the implementation itself, under the op's own autograd formula when
    grad mode is on and a tensor argument requires grad (an op without one is called as such then)."""
    tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
    if not runs_directly(tensors):
        return op(*args)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        if custom_op_part(op, "_backward_fn") is None:
            return op(*args)
        args = (*args, *_defaults(op)[len(args):])
        positions = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        return _OwnAutograd.apply(op, args, positions, *tensors)
    return custom_op_part(op, "_init_fn")(*args)


@functools.cache
def _defaults(op) -> tuple:
    """The default values of ``op``'s arguments, in schema order."""
    return tuple(a.default_value for a in torch_compat.schema_arguments(op))


class _OwnAutograd(torch.autograd.Function):
    """``op``'s implementation with its registered ``setup_context`` / ``backward``, as ``torch.library`` runs them
    (the same saved state, ``needs_input_grad`` per argument, the same gradients), for :func:`call`. The tensor
    arguments are ``apply``'s own (autograd tracks them); ``args`` holds every argument in schema order,
    ``positions`` where the tensors sit in it."""

    @staticmethod
    def forward(ctx, op, args, positions, *tensors):
        output = custom_op_part(op, "_init_fn")(*args)
        custom_op_part(op, "_setup_context_fn")(ctx=ctx, inputs=args, output=output)
        ctx.attnops_call = (op, len(args), positions)
        return output

    @staticmethod
    def backward(ctx, *grads):
        op, n_args, positions = ctx.attnops_call
        needs = [False] * n_args
        for i, need in zip(positions, ctx.needs_input_grad[3:]):
            needs[i] = need
        own, ctx.needs_input_grad = ctx.needs_input_grad, tuple(needs)
        try:
            result = custom_op_part(op, "_backward_fn")(ctx, *grads)
        finally:
            ctx.needs_input_grad = own
        result = result if isinstance(result, tuple) else (result,)
        return (None, None, None, *(result[i] for i in positions))
