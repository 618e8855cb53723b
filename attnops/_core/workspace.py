"""Per-thread reusable workspaces of the CPU references (shared by every operator's worker jobs)."""
from __future__ import annotations

import math
import weakref

import torch

from .parallel import thread_store

_EVERY_THREAD: weakref.WeakSet = weakref.WeakSet()  # every thread's Buffers, for drop_cached_workspaces
CACHED_WORKSPACE_BYTES = 256 << 20  # workspaces up to this size stay allocated between calls (per thread)
MAX_CACHED_VIEWS = 512


class Buffers:
    """Named, reused fp32/fp64 buffers (grown on demand), so the tile loop allocates nothing.

    Large allocations start on page boundaries, so buffers streamed side by side (``P * dP``, a GEMM writing one
    while reading another) would share their address bits below 4 KiB and collide in the caches; each buffer is
    therefore used from a different offset (a few cache lines apart)."""

    def __init__(self, dtype: torch.dtype, device):
        self.dtype, self.device, self._bufs, self._views = dtype, device, {}, {}

    @staticmethod
    def acquire(dtype: torch.dtype, device) -> "Buffers":
        """This thread's buffers for ``(dtype, device)``, kept from call to call: re-allocating tens of MB per call
        lets the C allocator return them to the system and fault them in again (slow in a VM)."""
        cache = thread_store().setdefault("buffers", {})
        key = (dtype, str(device))
        if key not in cache:
            cache[key] = Buffers(dtype, device)
            _EVERY_THREAD.add(cache[key])
        return cache[key]

    def drop(self) -> None:
        """Free every buffer (they are allocated again on demand)."""
        self._bufs.clear()
        self._views.clear()

    def release(self) -> None:
        """Drop the buffers after a call when they exceed ``CACHED_WORKSPACE_BYTES`` (long sequences)."""
        if sum(b.numel() for b in self._bufs.values()) * self.dtype.itemsize > CACHED_WORKSPACE_BYTES:
            self.drop()

    def get(self, name: str, *shape: int) -> torch.Tensor:
        """Buffer ``name`` viewed as ``shape`` (views are kept: the tile loops ask for the same few shapes, and every
        tensor call of a worker contends for the GIL)."""
        view = self._views.get((name, shape))
        if view is not None:
            return view
        n = math.prod(shape)
        with torch.inference_mode(False):  # kept across calls: a buffer or view made in inference mode would refuse
            buf = self._bufs.get(name)     # the in-place writes of a later call outside it
            if buf is None or buf.numel() < n:
                skew = (len(self._bufs) * 5 + 1) * (64 // self.dtype.itemsize) % 1024
                buf = torch.empty(n + skew, dtype=self.dtype, device=self.device)[skew:]
                self._bufs[name] = buf
                self._views = {key: v for key, v in self._views.items() if key[0] != name}
            if len(self._views) >= MAX_CACHED_VIEWS:
                self._views.clear()
            view = self._views[(name, shape)] = buf[:n].view(shape)
        return view


def drop_cached_workspaces() -> None:
    """Free the workspaces every thread keeps between calls, for a process that needs the memory more than the
    speed of its next call (``attnops compare`` between its re-runs). Only while no call is running."""
    for buffers in list(_EVERY_THREAD):
        buffers.drop()
