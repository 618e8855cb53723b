"""Host metadata to the device without synchronising: built on the host, staged in pinned (page-locked) memory
and copied with ``non_blocking=True`` (FlashInfer's plan does the same), so the host never waits for the GPU.

:func:`upload` copies every time; :func:`cached_upload` keeps the device copy of metadata that repeats from call to
call (dense shapes, a fixed batch composition), so a steady training or decoding loop uploads nothing and the
tensor a CUDA graph captured stays alive at the same address. :func:`device_constant` keeps tensors built on the
device from a few arguments (index ranges, fixed masks) the same way.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

CACHE_ENTRIES = 1024  # device copies kept (a few hundred bytes each), least recently used dropped first
_CACHE: OrderedDict[tuple, torch.Tensor] = OrderedDict()


def upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (a number, a list or nested lists, or a CPU tensor) as a ``dtype`` tensor on ``device``: staged in
    pinned memory on CUDA and copied without blocking; CPU tensors come back as they are."""
    device = torch.device(device)
    if isinstance(values, torch.Tensor):
        host = values.to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def cached_upload(key: Hashable, build: Callable[[], object], dtype: torch.dtype, device: torch.device
                  ) -> torch.Tensor:
    """The device tensor of ``build()`` (:func:`upload`), built and uploaded once per ``key`` and device: the
    result is shared between calls and must never be written to."""
    full_key = (key, dtype, torch.device(device))
    tensor = _CACHE.get(full_key)
    if tensor is None:
        tensor = _CACHE[full_key] = upload(build(), dtype, device)
        if len(_CACHE) > CACHE_ENTRIES:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(full_key)
    return tensor


def device_constant(maxsize: int = 16):
    """Decorator: keep the tensors a function builds on the device from hashable arguments (one per argument set,
    never written), like ``functools.lru_cache``; under ``torch.compile`` the function runs as it is, so the traced
    graph builds the tensor (a kept tensor cannot be traced)."""
    def decorate(build: Callable) -> Callable:
        kept = functools.lru_cache(maxsize=maxsize)(build)

        @functools.wraps(build)
        def constant(*args):
            return build(*args) if torch.compiler.is_compiling() else kept(*args)
        return constant
    return decorate


def upload_if_host(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """A metadata tensor on ``device`` for the kernels: a host tensor uploaded (:func:`upload`, same dtype), one
    already there as it is, None as None."""
    if t is None or t.device == torch.device(device):
        return t
    return upload(t, t.dtype, device)
