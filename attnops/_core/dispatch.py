"""The one place that picks a backend, from static facts only (device, dtype, features).

``backend="auto"`` chooses the Triton kernels on CUDA when their verifier accepts the call, else the reference.
An explicit backend that cannot serve a call raises with the reason; it never falls back silently.
``ATTNOPS_BACKEND=reference|triton`` overrides ``auto`` for debugging.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch

from .checks import fail

BACKENDS = ("auto", "reference", "triton")


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on ``device`` (None when it can)."""
    if os.environ.get("ATTNOPS_TRITON_INTERPRET") != "1" and device.type != "cuda":
        return f"Triton kernels need a CUDA device (got {device.type}); set ATTNOPS_TRITON_INTERPRET=1 to use the CPU interpreter"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install triton)"
    return "no Triton kernel is implemented for this operator yet"


def choose_backend(backend: str, device: torch.device, verify_triton: Callable[[], str | None] | None = None) -> str:
    """Resolve ``backend`` to ``"reference"`` or ``"triton"``; raise if an explicit choice cannot serve the call."""
    if backend not in BACKENDS:
        fail("backend", f"one of {list(BACKENDS)}", backend)
    if backend == "auto":
        backend = os.environ.get("ATTNOPS_BACKEND", "auto")
        if backend not in BACKENDS:
            fail("ATTNOPS_BACKEND", f"one of {list(BACKENDS)}", backend)
    if backend == "reference":
        return "reference"
    reason = triton_unavailable_reason(device) if verify_triton is None else verify_triton()
    if reason is None:
        return "triton"
    if backend == "triton":
        fail("backend", "a backend that can serve this call", "'triton'", f"Triton cannot: {reason}")
    return "reference"
