"""Validated NSA call specs remembered per call configuration: a call whose spec depends on the shapes, dtypes and
devices of its tensors and on its host values only (the common training and decoding step) is validated once per
configuration, then its spec is reused (a failing call raises every time: nothing is remembered for it).

Tensors count by shape, dtype and device, except those a spec holds (masks), which count by identity and only when
reading them costs nothing and changes nothing: bool tensors off the CPU (kept as given, their values never read on
the host). Host values count exactly (lists of ints as tuples, with their types); any other argument (a CPU mask, a
list of NumPy integers) makes the call unkeyed: validated afresh.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch

ENTRIES = 256  # specs remembered (least recently used dropped first)
_SPECS: OrderedDict[tuple, Any] = OrderedDict()
_SCALARS = frozenset((int, float, str, bool, type(None)))


class _Unkeyed(Exception):
    """An argument without a key: the call is validated afresh."""


def _shaped(value) -> tuple | None:
    """The key of a tensor that counts by its shape, dtype and device (None: absent)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise _Unkeyed
    return value.shape, value.dtype, value.device


def _host(value) -> tuple:
    """The key of a host value: scalars and lists of ints exactly (with their types)."""
    kind = type(value)
    if kind in _SCALARS:
        return kind, value
    if kind in (list, tuple) and all(type(v) is int for v in value):
        return kind, tuple(value)
    raise _Unkeyed


def _held(value) -> tuple | None:
    """The key of a tensor the spec holds: its identity and layout, for a bool tensor off the CPU."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.device.type == "cpu" or value.dtype != torch.bool:
        raise _Unkeyed
    return id(value), value.shape, value.stride(), value.storage_offset(), value.device


def memoized(build: Callable, *tensors, held: tuple[str, ...] = (), **kwargs):
    """``build(*tensors, **kwargs)``, remembered under the arguments' key: ``tensors`` (tensors or None) count by
    shape, dtype and device, the keyword arguments are host values, except those named in ``held``: tensors the spec
    holds (see the module docstring). Not remembered while ``torch.compile`` traces the caller."""
    if torch.compiler.is_compiling():
        return build(*tensors, **kwargs)
    try:
        key = (build, tuple(map(_shaped, tensors)),
               tuple((name, _held(v) if name in held else _host(v)) for name, v in kwargs.items()))
    except _Unkeyed:
        return build(*tensors, **kwargs)
    spec = _SPECS.get(key)
    if spec is None:
        spec = _SPECS[key] = build(*tensors, **kwargs)
        if len(_SPECS) > ENTRIES:
            _SPECS.popitem(last=False)
        return spec
    try:
        _SPECS.move_to_end(key)
    except KeyError:  # dropped meanwhile by another thread: the spec stays valid
        pass
    return spec
