"""The CPU reference's fp32 GEMM ``x @ w.T``: oneDNN's matmul where PyTorch ships it, else ``torch.mm``.

PyTorch's ``torch.mm`` calls MKL's SGEMM; the oneDNN library bundled with PyTorch has AVX-512 kernels that run the
attention tiles' shapes 5-15% faster on the machines we measured (``docs/performance.md``). It is reached through
``torch.ops.mkldnn._linear_pointwise`` (the op behind Inductor's CPU linear fusions), probed once against
``torch.mm``; without it everything runs on ``torch.mm``.

oneDNN is used only where it is fast: fp32 CPU tensors, products of at least ``ONEDNN_MIN_FLOPS`` (small GEMMs are
as fast in MKL), ``x`` with unit inner stride and ``w`` dense (row-major or a transposed row-major matrix: a strided
``w`` falls back to a slow reference kernel). Each new shape costs a primitive creation of 0.5-2 ms (cached for
1024 shapes), so callers whose shapes follow the data rather than a tiling (NSA's selected blocks) use ``torch.mm``.
oneDNN re-blocks ``w`` in every call; a ``w`` used by several calls is re-blocked once with :func:`pack_nt`.
Results are a GEMM's usual fp32 rounding; with one thread per call (the reference's workers) they do not depend
on the machine's thread count.
"""
from __future__ import annotations

import functools

import torch

ONEDNN_MIN_FLOPS = 1 << 21


def _probe_operands() -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed ``x [8, 16]``, ``w [24, 16]`` for the one-time probes (no draw from the global RNG: a user's seeded
    numbers must not depend on whether attnops ran a product first)."""
    return (torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16).sin(),
            torch.arange(24 * 16, dtype=torch.float32).reshape(24, 16).cos())


@functools.cache
def _onednn():
    """``torch.ops.mkldnn._linear_pointwise`` when present and correct on this machine, else None."""
    try:
        op = torch.ops.mkldnn._linear_pointwise
        x, w = _probe_operands()
        with torch.no_grad():
            ok = all(torch.allclose(op(x, w_, None, "none", [], ""), x @ w.t(), rtol=1e-5, atol=1e-5)
                     for w_ in (w, w.t().contiguous().t()))
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return op if ok else None


def _dense(w: torch.Tensor) -> bool:
    """Whether ``w`` (2-D) is row-major or a transposed row-major matrix (``w.t().is_contiguous()`` read from the
    strides: no view is made, this runs before every product)."""
    return w.is_contiguous() or (w.stride(0) == 1 and w.stride(1) == w.shape[0])


def _onednn_weight(w: torch.Tensor, rows: int) -> bool:
    """Whether products ``x @ w.T`` with ``rows`` rows of fp32 CPU ``x`` run on oneDNN."""
    return (w.device.type == "cpu" and w.dtype == torch.float32 and _dense(w)
            and 2 * rows * w.shape[1] * w.shape[0] >= ONEDNN_MIN_FLOPS and _onednn() is not None)


def use_onednn(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``mm_nt(x, w)`` runs on oneDNN (see the module docstring)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1 and _onednn_weight(w, x.shape[0])


@functools.cache
def _onednn_pack():
    """``torch.ops.mkldnn._reorder_linear_weight`` when present and consistent with the plain product, else None."""
    op = _onednn()
    if op is None:
        return None
    try:
        pack = torch.ops.mkldnn._reorder_linear_weight
        x, w = _probe_operands()
        with torch.no_grad():
            ok = torch.allclose(op(x, pack(w, 8), None, "none", [], ""), x @ w.t(), rtol=1e-5, atol=1e-5)
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return pack if ok else None


def pack_nt(w: torch.Tensor, rows: int) -> torch.Tensor | None:
    """``w`` (``[N, K]``) re-blocked once for several products ``mm_nt(x, w, packed=...)`` of about ``rows`` rows.

    oneDNN re-blocks a plain ``w`` in every call: measured 4-5% of a 512 x 4096 x 128 product, 7-8% at 256 rows
    and 20% at 128. None where ``mm_nt`` would not run ``x @ w.T`` on oneDNN (or cannot pack): pass ``w`` alone.
    """
    if not _onednn_weight(w, rows):
        return None
    pack = _onednn_pack()
    return None if pack is None else pack(w, rows)


def mm_nt(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
          packed: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` for ``x`` ``[M, K]`` and ``w`` ``[N, K]``: a new tensor from oneDNN (from ``packed``, the
    :func:`pack_nt` of ``w``, when given), else ``torch.mm`` (into ``out`` when given, a workspace)."""
    if use_onednn(x, w):
        return _onednn()(x, w if packed is None else packed, None, "none", [], "")
    return torch.mm(x, w.t(), out=out)


def add_mm_nt_(acc: torch.Tensor, x: torch.Tensor, w: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``acc += alpha * (x @ w.T)`` in place (oneDNN's product added in a second pass, or one ``addmm_``)."""
    if use_onednn(x, w):
        return acc.add_(_onednn()(x, w, None, "none", [], ""), alpha=alpha)
    return acc.addmm_(x, w.t(), alpha=alpha)
