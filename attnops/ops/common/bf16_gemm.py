"""The bf16 x bf16 -> fp32 GEMM of the chunked CPU attention engine (``cpu_kernels/gemm_bf16.cpp``, in the library
of the decode kernel), for CPUs with AVX512-BF16: exact products of bf16 pairs summed in fp32, many times the speed
of PyTorch's fp32 GEMM of the same operands (``docs/performance.md``), on the tile unit where the CPU has AMX-BF16
(``ATTNOPS_CPU_AMX=0``, read once per process, keeps them on AVX512-BF16; :func:`unit` says which); with it the
backward's dS formed in the dP GEMM's products (:func:`grad_gemm_`) and a blocked transpose of bf16 operands
(:func:`transpose_`).

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

_lock = threading.Lock()
_bound: dict = {}


def bound_library():
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
                lib.attnops_bf16_forward_tiles.argtypes = [i64, p, p, ctypes.c_float]
                lib.attnops_bf16_forward_tiles.restype = i32
                _bound["unit"] = _UNITS.get(lib.attnops_bf16_gemm_ready())
                lib = lib if _bound["unit"] else None
            _bound["lib"] = lib
    return _bound["lib"]


_UNITS = {1: "AVX512-BF16", 2: "AMX-BF16"}


def unit() -> str | None:
    """What the bf16 GEMM runs on in this process ("AMX-BF16" or "AVX512-BF16"), None without it."""
    bound_library()
    return _bound.get("unit")


def bf16_gemm(device: torch.device) -> bool:
    """Whether bf16 products on ``device`` may run on the bf16 GEMM."""
    return (device.type == "cpu" and os.environ.get("ATTNOPS_CPU_BF16_GEMM", "1") != "0"
            and not torch.compiler.is_compiling() and bound_library() is not None)


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
    code = bound_library().attnops_bf16_gemm(m, n, k, a.data_ptr(), lda, b.data_ptr(), ldb, int(b_nt), out.data_ptr(),
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
    code = bound_library().attnops_bf16_gemm_grad(m, n, k, a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0),
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
    bound_library().attnops_transpose16(r, c, x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0))
    return out
