"""Decode plans reused by one-call FIA decodes (what a model makes once per layer per step, with the same lengths and
block table across the layers of a step): the validation, the verifier and the host arithmetic of
:func:`~.decode_plan.make_plan` run once per distinct call, and a repeated call only launches.

The key is everything the plan depends on: the query, key and value shapes, strides, dtypes and devices (their data is
read at each launch, so new tensors of the same layout share a plan), every option by value (host lengths included),
every tensor option by identity and version counter (``tensor._version``, bumped by every in-place write), the
backend choice, the dry-run and interpreter state, and the CUDA stream (the plan's partial buffers serve one stream).
An entry holds its tensor options, so an identity cannot be reused while it is cached. Calls the key cannot describe
safely are not cached: tensor lists, lengths that are not plain ints, inference tensors (no version counter).
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict

import torch

from ...._core.triton import dry_run
from .decode_plan import DecodePlan

CAPACITY = 32  # distinct calls kept (layers of different shapes, a few batch compositions)

_PLANS: OrderedDict = OrderedDict()
_LOCK = threading.Lock()


def _layout(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


def _option(value, held: list):
    """``value`` as a key part (a tensor by identity and version, held in ``held``), or raise ``TypeError``."""
    if value is None or type(value) in (int, float, bool, str):
        return value
    if isinstance(value, torch.Tensor):
        if value.is_inference():
            raise TypeError("an inference tensor has no version counter")
        held.append(value)
        return id(value), value._version, _layout(value)
    if isinstance(value, (list, tuple)) and all(type(x) is int for x in value):
        return tuple(value)
    raise TypeError(f"{type(value).__name__} is not a key part")


def call_key(query, key, value, options: dict, backend: str) -> tuple[tuple, list] | None:
    """``(key, held tensors)`` of a call, or None when the call is not cached."""
    if not (isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)):
        return None
    held: list = []
    try:
        parts = tuple((name, _option(x, held)) for name, x in options.items())
    except TypeError:
        return None
    device = query.device
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else None
    state = (backend, os.environ.get("ATTNOPS_BACKEND"), dry_run.active() is not None, stream)
    return (_layout(query), _layout(key), _layout(value), state, parts), held


def lookup(call: tuple[tuple, list] | None) -> DecodePlan | None:
    """The plan stored for ``call`` (:func:`call_key`), or None."""
    if call is None:
        return None
    with _LOCK:
        entry = _PLANS.get(call[0])
        if entry is None:
            return None
        _PLANS.move_to_end(call[0])
        return entry[0]


def store(call: tuple[tuple, list] | None, plan: DecodePlan) -> None:
    """Keep ``plan`` for ``call`` (and its tensor options), dropping the least recently used beyond
    :data:`CAPACITY`."""
    if call is None:
        return
    with _LOCK:
        _PLANS[call[0]] = (plan, call[1])
        while len(_PLANS) > CAPACITY:
            _PLANS.popitem(last=False)


def clear() -> None:
    """Drop every cached plan (and the tensors their entries hold)."""
    with _LOCK:
        _PLANS.clear()
