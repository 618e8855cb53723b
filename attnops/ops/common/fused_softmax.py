"""The fused softmax passes of the chunked CPU attention engine (``cpu_kernels/softmax.cpp``, in the library of the
decode kernel): the forward's online-softmax step and the backward's probabilities and dS, each one call per fp32 tile.

:func:`fused_softmax` says whether a call's tiles may use them (the library is built and loaded, the tiles are fp32
on the CPU, nothing is being traced); the engine keeps its PyTorch passes otherwise. The tiles must have unit
column stride and the per-row vectors (``[rows, 1]``) consecutive rows; the wrappers check it. A ctypes call
releases the GIL, so the engine's worker threads run these passes side by side.
"""
from __future__ import annotations

import ctypes
import threading

import torch

from .cpu_kernels import library

_lock = threading.Lock()
_bound: dict = {}


def _functions():
    """The library with the three entry points' signatures set (once), or None without a library."""
    lib = library()
    if lib is None:
        return None
    if "lib" not in _bound:
        with _lock:
            p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
            lib.attnops_softmax_block.argtypes = [p, i64, i64, i64, p, p, p, i32, i32, p, i64, i64, i64, i64]
            lib.attnops_softmax_probs.argtypes = [p, i64, i64, i64, p, p, p, i64, i64, i64, i64]
            lib.attnops_softmax_grad.argtypes = [p, p, i64, i64, i64, i64, p, i32, p, i64]
            for fn in (lib.attnops_softmax_block, lib.attnops_softmax_probs, lib.attnops_softmax_grad):
                fn.restype = i32
            _bound["lib"] = lib
    return _bound["lib"]


def fused_softmax(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether tiles of ``dtype`` on ``device`` run the fused passes."""
    return (dtype == torch.float32 and device.type == "cpu" and not torch.compiler.is_compiling()
            and _functions() is not None)


def _tile(s: torch.Tensor) -> int:
    """The row stride of a 2-D tile with unit column stride."""
    if s.dim() != 2 or s.dtype != torch.float32 or (s.shape[1] > 1 and s.stride(1) != 1):
        raise ValueError(f"fused softmax: a 2-D fp32 tile with unit column stride expected, got shape "
                         f"{tuple(s.shape)}, strides {s.stride()}, {s.dtype}")
    return s.stride(0)


def _rounded(out16: torch.Tensor | None, shape) -> tuple[int | None, int]:
    """The address and row stride of ``out16``, the bf16 copy of a tile of ``shape`` (None: no copy)."""
    if out16 is None:
        return None, 0
    if out16.dtype != torch.bfloat16 or out16.shape != shape or (shape[1] > 1 and out16.stride(1) != 1):
        raise ValueError(f"fused softmax: a bf16 tile of shape {tuple(shape)} with unit column stride expected, got "
                         f"shape {tuple(out16.shape)}, strides {out16.stride()}, {out16.dtype}")
    return out16.data_ptr(), out16.stride(0)


def _rows(v: torch.Tensor, rows: int) -> int:
    """The address of a ``[rows, 1]`` fp32 vector of consecutive rows."""
    if v.dtype != torch.float32 or v.shape[0] != rows or v.numel() != rows or (rows > 1 and v.stride(0) != 1):
        raise ValueError(f"fused softmax: a [{rows}, 1] fp32 row vector expected, got shape {tuple(v.shape)}, "
                         f"strides {v.stride()}, {v.dtype}")
    return v.data_ptr()


def band_args(band: tuple[int, int, int] | None, rows: int, cols: int) -> tuple[int, int, int]:
    """The kernels' ``(lo, hi, prefix)`` of a ``rows x cols`` tile: ``band`` (its ``MaskSpec.tile_band``), or a
    band that keeps every entry for None."""
    return (-rows, cols, 0) if band is None else band


def softmax_block_(s: torch.Tensor, m: torch.Tensor, l: torch.Tensor, rescale: torch.Tensor | None,
                   clamp: bool, out16: torch.Tensor | None = None, band: tuple[int, int, int] | None = None) -> None:
    """One column block of the online softmax in place (see ``attnops_softmax_block``): ``s`` ([r, c]) becomes
    ``exp2((s - m) * log2 e)`` with ``m``/``l`` ([r, 1]) the running max and sum. ``rescale`` None: the row's first
    block (``m`` and ``l`` start here; ``clamp``: a -inf max becomes the lowest float); else it receives
    ``exp2((m_old - m) * log2 e)``, the factor the output accumulated so far must be scaled by. ``out16``: a bf16
    tile that also receives ``s`` rounded (to nearest even, denormals flushed to 0). ``band``: the tile's
    ``MaskSpec.tile_band``, whose masked scores become -inf first (as ``MaskSpec.fill_masked_`` sets them)."""
    r, c = s.shape
    first = rescale is None
    _functions().attnops_softmax_block(s.data_ptr(), r, c, _tile(s), _rows(m, r), _rows(l, r),
                                       None if first else _rows(rescale, r), int(first), int(clamp),
                                       *_rounded(out16, s.shape), *band_args(band, r, c))


def probabilities_(s: torch.Tensor, m: torch.Tensor, neg_log2_l: torch.Tensor,
                   out16: torch.Tensor | None = None, band: tuple[int, int, int] | None = None) -> None:
    """In place: ``s = exp2((s - m) * log2 e - log2 l)`` from the given statistics (``m``, ``-log2 l``: [r, 1]);
    ``out16``, ``band``: see :func:`softmax_block_`."""
    r, c = s.shape
    _functions().attnops_softmax_probs(s.data_ptr(), r, c, _tile(s), _rows(m, r), _rows(neg_log2_l, r),
                                       *_rounded(out16, s.shape), *band_args(band, r, c))


def grad_(p: torch.Tensor, dp: torch.Tensor, delta: torch.Tensor, unit_zero: bool = False,
          out16: torch.Tensor | None = None) -> None:
    """In place of ``p``: ``dS = p * (dp - delta)`` (``delta``: [r, 1]); ``unit_zero``: 0 where ``p == 1``;
    ``out16``: see :func:`softmax_block_`."""
    r, c = p.shape
    if dp.shape != p.shape:
        raise ValueError(f"fused softmax: dp of shape {tuple(p.shape)} expected, got {tuple(dp.shape)}")
    _functions().attnops_softmax_grad(p.data_ptr(), dp.data_ptr(), r, c, _tile(p), _tile(dp), _rows(delta, r),
                                      int(unit_zero), *_rounded(out16, p.shape))
