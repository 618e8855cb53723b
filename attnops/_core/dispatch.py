"""The one place that picks a backend, from static facts only (device, dtype, features).

``backend="auto"`` chooses the Triton kernels on CUDA when their verifier accepts the call, else the reference.
An explicit backend that cannot serve a call raises with the reason; it never falls back silently.
When ``auto`` on CUDA must run the reference, a :class:`~attnops._core.errors.PerformanceWarning` says why, once
per reason. ``ATTNOPS_BACKEND=reference|triton`` overrides ``auto`` for debugging. ``ATTNOPS_TRITON_INTERPRET=1`` lets
CPU tensors run the Triton kernels through Triton's interpreter when Triton is chosen explicitly (``auto`` keeps the
reference on the CPU). Inside :func:`attnops.testing.gpu_dry_run` every device counts as a GPU: ``auto`` takes the
Triton path, whose launches are recorded, and a call the kernels cannot serve raises instead of falling back.
"""
from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable

import torch

from .checks import Described, fail
from .errors import PerformanceWarning
from .triton import dry_run

BACKENDS = ("auto", "reference", "triton")
_WARNED: set[str] = set()  # the reasons a PerformanceWarning was issued for (once each)


def triton_interpret_requested() -> bool:
    """``ATTNOPS_TRITON_INTERPRET=1``: CPU tensors may run the Triton kernels through Triton's interpreter."""
    return os.environ.get("ATTNOPS_TRITON_INTERPRET") == "1"


def enable_triton_interpreter() -> bool:
    """Turn Triton's interpreter on for this process if Triton is not imported yet (it reads ``TRITON_INTERPRET``
    when its language module is first imported); returns whether the interpreter is on."""
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET") == "1"


if triton_interpret_requested():
    enable_triton_interpreter()  # before anything (torch.library included) imports Triton


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on ``device`` at all (None when it can)."""
    if dry_run.active() is not None:
        return None  # launches are recorded, not run: any device stands for a GPU
    if device.type != "cuda" and not (device.type == "cpu" and triton_interpret_requested()):
        return (f"Triton kernels need a CUDA device (got {device.type}); set ATTNOPS_TRITON_INTERPRET=1 to run them "
                "on CPU tensors through Triton's interpreter")
    if device.type == "cpu" and not enable_triton_interpreter():
        return ("Triton was imported in this process without TRITON_INTERPRET=1, so its interpreter is off; set "
                "ATTNOPS_TRITON_INTERPRET=1 (or TRITON_INTERPRET=1) before attnops and triton are imported")
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install triton)"
    return None


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
    dry = dry_run.active() is not None
    if backend == "auto" and device.type != "cuda" and not dry:
        return "reference"  # the interpreter is for tests and debugging: only an explicit choice runs it
    if verify_triton is None:  # an operator without Triton kernels
        reason = triton_unavailable_reason(device) or "no Triton kernel is implemented for this operator yet"
    else:
        reason = verify_triton()
    if reason is None:
        return "triton"
    if backend == "triton":
        fail("backend", "a backend that can serve this call", Described("'triton'"), f"Triton cannot: {reason}")
    if dry:
        raise RuntimeError(f"gpu_dry_run: this call would run the reference instead of the Triton kernels: {reason}")
    _warn_fallback(reason)
    return "reference"


def _warn_fallback(reason: str) -> None:
    """One :class:`PerformanceWarning` per distinct reason (a training loop would otherwise warn every step)."""
    if reason in _WARNED:
        return
    _WARNED.add(reason)
    warnings.warn(f"attnops: backend 'auto' runs the reference (on CPU copies, orders of magnitude slower) instead of "
                  f"the Triton kernels: {reason}. Change the call as the reason says to run on the kernels, or pass "
                  "backend='reference' to choose the reference knowingly.", PerformanceWarning, stacklevel=4)
