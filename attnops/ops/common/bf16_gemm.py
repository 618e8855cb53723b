"""The bf16 x bf16 -> fp32 GEMM of the chunked CPU attention engine (``cpu_kernels/gemm_bf16.cpp``, in the library
of the decode kernel), for CPUs with AVX512-BF16: exact products of bf16 pairs summed in fp32, about four times
the speed of the fp32 GEMM of the same operands (``docs/performance.md``).

:func:`bf16_gemm` says whether a call may use it: the library is built for and runs on a CPU with AVX512-BF16
(the library checks both, at build time and with ``cpuid``), the tensors are on the CPU, nothing is being traced.
Elsewhere (AVX2-only or aarch64 CPUs, portable builds, ``ATTNOPS_CPU_KERNELS=0``) the engine keeps its fp32
products. A ctypes call releases the GIL, so the engine's workers run their products side by side.
"""
from __future__ import annotations

import ctypes
import threading

import torch

from .cpu_kernels import library

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
                lib = lib if lib.attnops_bf16_gemm_ready() == 1 else None
            _bound["lib"] = lib
    return _bound["lib"]


def bf16_gemm(device: torch.device) -> bool:
    """Whether bf16 products on ``device`` may run on the bf16 GEMM."""
    return device.type == "cpu" and not torch.compiler.is_compiling() and _functions() is not None


def _rows(x: torch.Tensor, name: str, dtype: torch.dtype) -> int:
    """The row stride of a 2-D ``dtype`` operand with unit column stride."""
    if x.dim() != 2 or x.dtype != dtype or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"bf16 GEMM: {name} must be a 2-D {dtype} matrix with unit column stride, got shape "
                         f"{tuple(x.shape)}, strides {x.stride()}, {x.dtype}")
    return x.stride(0)


def gemm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, b_nt: bool, alpha: float = 1.0,
          accumulate: bool = False) -> torch.Tensor:
    """``out = alpha * a @ b.T`` (``b_nt``: ``b`` is ``[N, K]``) or ``alpha * a @ b`` (``b`` is ``[K, N]``), plus
    ``out`` when ``accumulate``; ``a`` ``[M, K]`` bf16, ``out`` ``[M, N]`` fp32. Returns ``out``."""
    m, k = a.shape
    n = b.shape[0] if b_nt else b.shape[1]
    if tuple(b.shape) != ((n, k) if b_nt else (k, n)) or tuple(out.shape) != (m, n):
        raise ValueError(f"bf16 GEMM: shapes a {tuple(a.shape)}, b {tuple(b.shape)} ({'nt' if b_nt else 'nn'}), "
                         f"out {tuple(out.shape)} do not match")
    lda, ldb = _rows(a, "a", torch.bfloat16), _rows(b, "b", torch.bfloat16)
    ldc = _rows(out, "out", torch.float32)
    code = _functions().attnops_bf16_gemm(m, n, k, a.data_ptr(), lda, b.data_ptr(), ldb, int(b_nt), out.data_ptr(),
                                          ldc, alpha, int(accumulate))
    if code:
        raise RuntimeError(f"attnops_bf16_gemm returned {code}")
    return out
