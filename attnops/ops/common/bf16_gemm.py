"""The bf16 x bf16 -> fp32 GEMM of the chunked CPU attention engine (``cpu_kernels/gemm_bf16.cpp``, in the library
of the decode kernel), for CPUs with AVX512-BF16: exact products of bf16 pairs summed in fp32, many times the speed
of PyTorch's fp32 GEMM of the same operands (``docs/performance.md``); with it the backward's dS formed in the dP
GEMM's registers (:func:`grad_gemm_`) and a blocked transpose of bf16 operands (:func:`transpose_`).

:func:`bf16_gemm` says whether a call may use it: the library is built for and runs on a CPU with AVX512-BF16
(the library checks both, at build time and with ``cpuid``), the tensors are on the CPU, nothing is being traced.
Elsewhere (AVX2-only or aarch64 CPUs, portable builds, ``ATTNOPS_CPU_KERNELS=0``), and with
``ATTNOPS_CPU_BF16_GEMM=0`` (read at every call), the engine keeps its fp32 products of the widened operands. A
ctypes call releases the GIL, so the engine's workers run their products side by side.
"""
from __future__ import annotations

import ctypes
import os
import threading

import torch

from .cpu_kernels import library
from .fused_softmax import band_args

_lock = threading.Lock()
_bound: dict = {}


def _functions():
    """The library with the entry points' signatures set (once), or None without a library or without a bf16
    GEMM in it (the build or the CPU lacks AVX512-BF16)."""
    if "lib" not in _bound:
        with _lock:
            lib = library()
            if lib is not None:
                p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
                lib.attnops_bf16_gemm_ready.argtypes, lib.attnops_bf16_gemm_ready.restype = [], i32
                lib.attnops_bf16_gemm.argtypes = [i64, i64, i64, p, i64, p, i64, i32, p, i64, ctypes.c_float, i32]
                lib.attnops_bf16_gemm.restype = i32
                lib.attnops_bf16_gemm_grad.argtypes = [i64, i64, i64, p, i64, p, i64, p, i64, p, i32, p, i64]
                lib.attnops_bf16_gemm_grad.restype = i32
                lib.attnops_transpose16.argtypes, lib.attnops_transpose16.restype = [i64, i64, p, i64, p, i64], i32
                lib.attnops_bf16_backward_tiles.argtypes = [i64, p, p, i32, ctypes.c_float]
                lib.attnops_bf16_backward_tiles.restype = i32
                lib.attnops_bf16_forward_tile.argtypes = ([i64] * 4 + [p, i64] * 3 + [ctypes.c_float, p, p, p, i32]
                                                          + [p, i64] * 4 + [i64] * 3)
                lib.attnops_bf16_forward_tile.restype = i32
                lib = lib if lib.attnops_bf16_gemm_ready() == 1 else None
            _bound["lib"] = lib
    return _bound["lib"]


def bf16_gemm(device: torch.device) -> bool:
    """Whether bf16 products on ``device`` may run on the bf16 GEMM."""
    return (device.type == "cpu" and os.environ.get("ATTNOPS_CPU_BF16_GEMM", "1") != "0"
            and not torch.compiler.is_compiling() and _functions() is not None)


def gemm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, b_nt: bool, alpha: float = 1.0,
          accumulate: bool = False) -> torch.Tensor:
    """``out = alpha * a @ b.T`` (``b_nt``: ``b`` is ``[N, K]``) or ``alpha * a @ b`` (``b`` is ``[K, N]``), plus
    ``out`` when ``accumulate``; ``a`` ``[M, K]`` bf16, ``out`` ``[M, N]`` fp32, each with unit column stride.
    Returns ``out``. (Lean checks: the engine makes five calls per tile, and every Python step holds the GIL.)"""
    m, k = a.shape
    n, kb = b.shape if b_nt else (b.shape[1], b.shape[0])
    (lda, ca), (ldb, cb), (ldc, cc) = a.stride(), b.stride(), out.stride()
    if (kb != k or out.shape != (m, n) or a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16
            or out.dtype != torch.float32 or (ca != 1 and k > 1) or (cb != 1 and b.shape[1] > 1)
            or (cc != 1 and n > 1)):
        raise ValueError(f"bf16 GEMM: a {tuple(a.shape)} {a.dtype} strides {a.stride()}, b {tuple(b.shape)} "
                         f"{b.dtype} strides {b.stride()} ({'nt' if b_nt else 'nn'}), out {tuple(out.shape)} "
                         f"{out.dtype} strides {out.stride()}: expected a [M, K] and b [N, K] (nt) or [K, N] (nn) "
                         "in bf16 and out [M, N] in fp32, with unit column strides")
    code = _functions().attnops_bf16_gemm(m, n, k, a.data_ptr(), lda, b.data_ptr(), ldb, int(b_nt), out.data_ptr(),
                                          ldc, alpha, int(accumulate))
    if code:
        raise RuntimeError(f"attnops_bf16_gemm returned {code}")
    return out


GRAD_MAX_K = 256  # the longest reduction grad_gemm_ takes (one of the GEMM's blocks: its sums stay in registers)


def grad_gemm_(ds16: torch.Tensor, a: torch.Tensor, b: torch.Tensor, p: torch.Tensor, delta: torch.Tensor,
               unit_zero: bool) -> torch.Tensor:
    """The backward's score gradient rounded to bf16, from the registers of the dP GEMM: ``ds16 = P * (a @ b.T -
    delta)`` (0 where ``unit_zero`` and ``P == 1``), as :func:`gemm_` then ``fused_softmax.grad_`` with a bf16 copy
    give it, without their fp32 dP and dS tiles. ``a`` ``[M, K]`` and ``b`` ``[N, K]`` bf16 with ``K <=
    GRAD_MAX_K``, ``p`` ``[M, N]`` fp32, ``delta`` ``[M, 1]`` fp32 of consecutive rows, ``ds16`` ``[M, N]`` bf16,
    each with unit column stride. Returns ``ds16``."""
    m, k = a.shape
    n = b.shape[0]
    if (b.shape[1] != k or not 0 < k <= GRAD_MAX_K or p.shape != (m, n) or ds16.shape != (m, n)
            or delta.shape != (m, 1) or a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16
            or ds16.dtype != torch.bfloat16 or p.dtype != torch.float32 or delta.dtype != torch.float32
            or any(t.stride(1) != 1 and t.shape[1] > 1 for t in (a, b, p, ds16)) or (m > 1 and delta.stride(0) != 1)):
        raise ValueError(f"bf16 GEMM (dS): a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype}, p "
                         f"{tuple(p.shape)} {p.dtype}, delta {tuple(delta.shape)} {delta.dtype}, ds16 "
                         f"{tuple(ds16.shape)} {ds16.dtype}: expected a [M, K] and b [N, K] bf16 with 0 < K <= "
                         f"{GRAD_MAX_K}, p [M, N] and delta [M, 1] fp32, ds16 [M, N] bf16, unit column strides")
    code = _functions().attnops_bf16_gemm_grad(m, n, k, a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0),
                                               p.data_ptr(), p.stride(0), delta.data_ptr(), int(unit_zero),
                                               ds16.data_ptr(), ds16.stride(0))
    if code:
        raise RuntimeError(f"attnops_bf16_gemm_grad returned {code}")
    return ds16


def transpose_(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``out`` ``[C, R]`` = ``x`` ``[R, C]`` transposed, both bf16 with unit column stride (a blocked copy: PyTorch's
    copy of a transposed bf16 view is many times slower). Returns ``out``."""
    r, c = x.shape
    if (out.shape != (c, r) or x.dtype != torch.bfloat16 or out.dtype != torch.bfloat16
            or (c > 1 and x.stride(1) != 1) or (r > 1 and out.stride(1) != 1)):
        raise ValueError(f"bf16 transpose: x {tuple(x.shape)} {x.dtype} strides {x.stride()}, out "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}: expected x [R, C] and out [C, R] "
                         "in bf16 with unit column strides")
    _functions().attnops_transpose16(r, c, x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0))
    return out


class BackwardTiles:
    """One job's one-call backward tiles (the query heads of one KV head: row chunks x column blocks without explicit
    mask, pse, dropout or softcap), collected by :meth:`add` as rows of ints and run by :meth:`run` in one call
    (``attnops_bf16_backward_tiles``), in their order: per tile the products and passes the engine would make one
    by one (``s = alpha Q K^T`` masked by the tile's band, P with its bf16 copy, ``tv += dy^T P``, ``dS = P (dy V^T
    - delta)`` rounded, ``dq += alpha dS K``, ``tk += alpha Q^T dS``), with each chunk's Q and dy rows staged and
    transposed in C, without taking the GIL between them.

    Operands (checked once, here; the C walker checks every row of the table against their shapes before any
    write): bf16 ``q`` ``[G, Sq, d]``, ``dy`` ``[G, Sq, dv]`` (``dv <= GRAD_MAX_K``), ``k`` ``[Skv, d]``, ``v``
    ``[Skv, dv]``; fp32 ``m``, ``neg_log2_l``, ``delta`` ``[G, Sq, 1]`` (consecutive rows), ``dq`` ``[G, Sq, d]``,
    and at :meth:`run` ``tk`` ``[d, W]`` and ``tv`` ``[dv, W]``; unit column strides. ``fp32``/``bf16``: the
    thread's workspaces."""

    def __init__(self, q: torch.Tensor, dy: torch.Tensor, m: torch.Tensor, neg_log2_l: torch.Tensor,
                 delta: torch.Tensor, dq: torch.Tensor, k: torch.Tensor, v: torch.Tensor, unit_zero: bool,
                 alpha: float, fp32, bf16):
        bf, f32 = torch.bfloat16, torch.float32
        if not 0 < dy.shape[-1] <= GRAD_MAX_K:
            raise ValueError(f"bf16 backward tiles: dy {tuple(dy.shape)}: expected a head dim of 1 to {GRAD_MAX_K}")
        self._views = [x for t, dtype in ((q, bf), (dy, bf), (m, f32), (neg_log2_l, f32), (delta, f32), (dq, f32),
                                          (k, bf), (v, bf)) for x in _view(t, dtype)]
        self._dims, self._args, self._work = (q.shape[-1], dy.shape[-1]), (int(unit_zero), alpha), (fp32, bf16)
        self._rows: list[tuple[int, ...]] = []
        self._rmax = self._area = 0  # the tiles' most rows and most entries, for the workspaces

    def add(self, h: int, r0: int, r1: int, c0: int, c1: int, band: tuple[int, int, int] | None, tcol: int) -> None:
        """The tile of head ``h`` (of the ``G``), rows ``r0:r1`` and keys ``c0:c1``, masked by ``band`` (its
        ``MaskSpec.tile_band``; None: no band); its dK^T/dV^T sums go to columns ``tcol:tcol + c1 - c0``."""
        r, c = r1 - r0, c1 - c0
        self._rows.append((h, r0, r1, c0, c1, *band_args(band, r, c), tcol))
        self._rmax, self._area = max(self._rmax, r), max(self._area, r * c)

    def run(self, tk: torch.Tensor, tv: torch.Tensor) -> None:
        """The tiles added since the last run, in one call, with their dK^T/dV^T sums into ``tk``/``tv``."""
        if not self._rows:
            return
        (d, dv), (fp32, bf16), rmax, area = self._dims, self._work, self._rmax, self._area
        work = (fp32.get("s", area), bf16.get("p", area), bf16.get("ds", area), bf16.get("q", rmax * d),
                bf16.get("qt", rmax * d), bf16.get("dy", rmax * dv), bf16.get("dyt", rmax * dv))
        views = torch.tensor(self._views + _view(tk, torch.float32) + _view(tv, torch.float32)
                             + [x for w in work for x in (w.data_ptr(), 1, 1, w.numel(), 0, w.numel())],
                             dtype=torch.int64)  # (the workspaces: dense, of the dtypes they are asked in)
        table = torch.tensor(self._rows, dtype=torch.int64)
        code = _functions().attnops_bf16_backward_tiles(len(self._rows), table.data_ptr(), views.data_ptr(),
                                                        *self._args)
        self._rows, self._rmax, self._area = [], 0, 0
        if code:
            raise RuntimeError(f"attnops_bf16_backward_tiles returned {code}")


def _view(t: torch.Tensor, dtype: torch.dtype) -> list[int]:
    """``t`` (1 to 3 dims, ``dtype``, unit column stride) as ``attnops_bf16_backward_tiles`` takes an operand:
    address, heads, rows, columns, head stride, row stride."""
    if t.dtype != dtype or not 1 <= t.dim() <= 3 or (t.shape[-1] > 1 and t.stride(-1) != 1):
        raise ValueError(f"bf16 backward tiles: an operand {tuple(t.shape)} {t.dtype} strides {t.stride()}: "
                         f"expected 1 to 3 dims in {dtype} with unit column stride")
    shape, strides = (1,) * (3 - t.dim()) + tuple(t.shape), (0,) * (3 - t.dim()) + t.stride()
    if t.dim() == 1:
        strides = (0, t.shape[0], 1)
    return [t.data_ptr(), *shape, *strides[:2]]


def forward_tile_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: float, m: torch.Tensor, l: torch.Tensor,
                  clamp: bool, s: torch.Tensor, p16: torch.Tensor, o: torch.Tensor,
                  band: tuple[int, int, int] | None = None, rescale: torch.Tensor | None = None,
                  pv: torch.Tensor | None = None) -> None:
    """A forward column block of a row chunk without explicit mask, pse, dropout or softcap in one call
    (``attnops_bf16_forward_tile``: the same products and passes, in the same order, as the engine's separate
    calls): ``s = alpha Q K^T``, masked by ``band`` (its ``MaskSpec.tile_band``; None: no band), the online softmax's block on it
    with P rounded into ``p16``; the first block (``rescale`` None: ``m``, ``l`` start here; ``clamp``: see
    ``fused_softmax.softmax_block_``) makes ``o = P V``, a later one ``pv = P V`` and ``o = o * rescale + pv``
    (``rescale`` receives the online softmax's factor). bf16 ``q`` ``[r, d]``, ``k`` ``[c, d]``, ``v`` ``[c, dv]``,
    ``p16`` ``[r, c]``; fp32 ``m``, ``l``, ``rescale`` ``[r, 1]`` (consecutive rows), ``s`` ``[r, c]``, ``o`` and
    ``pv`` ``[r, dv]``; unit column strides."""
    (r, d), (c, dv) = q.shape, v.shape
    later = rescale is not None
    shapes = ((q, (r, d)), (k, (c, d)), (v, (c, dv)), (p16, (r, c)), (s, (r, c)), (o, (r, dv))) + (
        ((pv, (r, dv)),) if later else ())
    if (any(t.shape != shape or (shape[1] > 1 and t.stride(1) != 1)
            or t.dtype != (torch.bfloat16 if i < 4 else torch.float32) for i, (t, shape) in enumerate(shapes))
            or any(x.shape != (r, 1) or x.dtype != torch.float32 or (r > 1 and x.stride(0) != 1)
                   for x in (m, l, rescale) if x is not None)):
        raise ValueError("bf16 forward tile: " + ", ".join(f"{tuple(t.shape)} {t.dtype} strides {t.stride()}"
                                                          for t, _ in shapes)
                         + ": expected the shapes, dtypes and unit column strides of the docstring")
    code = _functions().attnops_bf16_forward_tile(
        r, c, d, dv, *(x for t in (q, k, v) for x in (t.data_ptr(), t.stride(0))), alpha, m.data_ptr(), l.data_ptr(),
        rescale.data_ptr() if later else None, int(clamp),
        *(x for t in (s, p16) for x in (t.data_ptr(), t.stride(0))),
        *((pv.data_ptr(), pv.stride(0)) if later else (None, 0)), o.data_ptr(), o.stride(0), *band_args(band, r, c))
    if code:
        raise RuntimeError(f"attnops_bf16_forward_tile returned {code}")
