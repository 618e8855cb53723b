"""``gpu_dry_run()``: the GPU hot path, checked on any machine.

Inside the context every device stands for a GPU: dispatch takes the Triton path for tensors on any device (``meta``
included) with the tile configurations a GPU would use, and each kernel launch is recorded
(:class:`~attnops._core.triton.dry_run.LaunchRecord`: kernel, grid, constexprs) instead of run. A call the kernels
cannot serve raises instead of falling back to the reference. With ``check_host_reads`` (the default) any
device-to-host read of a tensor's values on the path raises :class:`HostSyncError` naming the line: ``.item()``,
``int()``/``bool()`` of a tensor, ``.tolist()``, ``.cpu()``, ops whose output size depends on values (``nonzero``,
boolean indexing), a blocking host-to-device copy (metadata must go up with ``non_blocking=True``, from pinned
memory), and a kernel argument on another device than the call's (a tensor built on the CPU).

On ``meta`` tensors nothing has values, so the whole path runs in microseconds: the host cost of a call is what is
left (``python -m attnops bench --suite host-overhead``). Example::

    >>> q = torch.empty(1, 8, 128, 64, device="meta", dtype=torch.float16)
    >>> with attnops.testing.gpu_dry_run() as launches:
    ...     out = attnops.flash_attention(q, q, q, causal=True)
    >>> [launch.kernel for launch in launches]
    ['fwd_kernel']
"""
from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator

import torch

from .._core.dynamo import forget_traced_functions
from .._core.torch_compat import dispatch_mode_base, schema_arguments
from .._core.triton import dry_run
from .._core.triton.dry_run import HostSyncError, LaunchRecord

__all__ = ["HostSyncError", "LaunchRecord", "gpu_dry_run"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THIS = os.path.abspath(__file__)
_aten = torch.ops.aten
_VALUE_SIZED = {_aten.nonzero.default, _aten.masked_select.default, _aten.unique_dim.default,
                _aten._unique2.default, _aten.unique_consecutive.default, _aten.equal.default,
                _aten.is_nonzero.default, _aten.repeat_interleave.Tensor, _aten.nonzero_static.default}


def _is_device(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type != "cpu"


def _where() -> str:
    """``file:line (function)`` of the innermost attnops frame outside this module."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path.startswith(_PACKAGE) and path != _THIS:
            return f"{os.path.relpath(path, os.path.dirname(_PACKAGE))}:{frame.lineno} ({frame.name}): {frame.line}"
    return "outside attnops"


def _copy_problem(src: torch.Tensor, dst_device: torch.device, non_blocking: bool) -> str | None:
    if src.device.type != "cpu" and dst_device.type == "cpu":
        return "copies a device tensor to the host (.cpu()/.tolist()/.to('cpu'))"
    if src.device.type == "cpu" and dst_device.type != "cpu" and not non_blocking:
        return ("makes a blocking host-to-device copy (stage host metadata in pinned memory and copy it with "
                "non_blocking=True)")
    return None


def _named(func, args, kwargs) -> dict:
    """The call's arguments by schema name."""
    return {**dict(zip((a.name for a in schema_arguments(func)), args)), **kwargs}


def _host_read(func, args, kwargs) -> str | None:
    """Why ``func(*args, **kwargs)`` would synchronise with the device, or None."""
    packet = func.overloadpacket
    if packet in (_aten._local_scalar_dense, _aten.item) and _is_device(args[0]):
        return "reads a device tensor's value on the host (.item(), int(), float() or bool() of a tensor)"
    if func in _VALUE_SIZED and any(_is_device(a) for a in args):
        return f"runs {func.__name__}, whose output size depends on a device tensor's values"
    if packet in (_aten.index, _aten.index_put, _aten.index_put_) and _is_device(args[0]) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
        return "indexes with a boolean mask (its output size, or the positions it writes, depend on device values)"
    if packet in (_aten.to, _aten._to_copy, _aten.copy_):
        named = _named(func, args, kwargs)
        if packet is _aten.copy_:
            src, dst = named["src"], named["self"].device
        else:
            src = named["self"]
            dst = named["other"].device if "other" in named else named.get("device")
        if isinstance(src, torch.Tensor) and dst is not None:
            return _copy_problem(src, torch.device(dst), bool(named.get("non_blocking") or False))
    return None


class _HostReadGuard(dispatch_mode_base()):
    """Raises :class:`HostSyncError` at the first op that would read device values on the host."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _host_read(func, args, kwargs)
        if reason is not None:
            raise HostSyncError(f"gpu_dry_run: the Triton path {reason} at {_where()}")
        return func(*args, **kwargs)


def _creating_on_device(make):
    """``torch.tensor``/``torch.as_tensor`` that raise for host data created directly on another device (a blocking
    upload the dispatcher does not show)."""
    def create(data, *args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu" and not isinstance(data, torch.Tensor):
            raise HostSyncError(f"gpu_dry_run: the Triton path makes a blocking host-to-device copy "
                                f"(torch.{make.__name__} of host data with device={device}; stage it in pinned memory "
                                f"and copy it with non_blocking=True) at {_where()}")
        return make(data, *args, **kwargs)
    return create


@contextlib.contextmanager
def _guarded_constructors() -> Iterator[None]:
    saved = torch.tensor, torch.as_tensor
    torch.tensor, torch.as_tensor = (_creating_on_device(f) for f in saved)
    try:
        yield
    finally:
        torch.tensor, torch.as_tensor = saved
        forget_traced_functions()


@contextlib.contextmanager
def _host_read_guard() -> Iterator[None]:
    with _guarded_constructors(), _HostReadGuard():
        yield


@contextlib.contextmanager
def gpu_dry_run(check_host_reads: bool = True) -> Iterator[list[LaunchRecord]]:
    """Run the Triton path for tensors on any device with launches recorded, not run (module docstring); yields the
    list the launches are appended to. ``check_host_reads``: raise :class:`HostSyncError` at any host read of
    device values."""
    run = dry_run.push(_host_read_guard if check_host_reads else contextlib.nullcontext)
    try:
        with run.guard():
            yield run.launches
    finally:
        dry_run.pop(run)
