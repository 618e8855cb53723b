"""The MLA prolog's int8 quantized paths (``weight_quant_mode`` 1 / 2, ``kv_cache_quant_mode`` 1 with
``query_quant_mode`` 1, ``kv_cache_quant_mode`` 2), in the work dtype.

* ``weight_quant_mode`` 1: ``W_uq_qr`` is int8; ``c_q`` (after RmsNorm and ``qc_qr_scale``) is quantized per token,
  ``s = max|c_q * smooth| / 127``, ``code = round(c_q * smooth / s)`` (``smooth_scales_cq [1, Hcq]``, default 1), and
  ``[q_c | q_r] = (code @ W_uq_qr) * s * dequant_scale_w_uq_qr [1, N*(D+Dr)]``; ``query_norm`` is then ``code``
  (int8) with ``dequant_scale_q_norm = s [T, 1]``.
* ``weight_quant_mode`` 2: also ``token_x``, ``W_dq`` and ``W_dkv_kr`` are int8: ``x @ W`` is dequantized with
  ``dequant_scale_x [T, 1]`` (per token) times ``dequant_scale_w_dq [1, Hcq]`` / ``dequant_scale_w_dkv_kr
  [1, Hckv + Dr]`` (per column).
* ``kv_cache_quant_mode`` 1 with ``query_quant_mode`` 1 (per-tensor int8 cache, per token-head int8 query):
  ``kv_cache`` gets ``clamp(round(c_kv * quant_scale_ckv), -128, 127)``; ``query`` becomes
  ``clamp(round(query / s_q))`` with ``s_q = max|query| / 127`` per (token, head), returned as
  ``dequant_scale_q_nope [T, N, 1]``, and ``query_rope`` is brought to the same scale: ``query_rope *
  quant_scale_ckv / s_q`` (so ``q . k`` of the codes times ``s_q / quant_scale_ckv`` is the real score).
  ``quant_scale_ckv`` is ``[1]``, or ``[1, Hckv]`` with W8A8 weights (mode 2), of which, as on the NPU, only the
  first value is read.
* ``kv_cache_quant_mode`` 2 (per-channel int8 caches, query not quantized): ``kv_cache`` gets
  ``clamp(round(c_kv * quant_scale_ckv[0, c]))`` per channel ``c`` (``quant_scale_ckv [1, Hckv]``); with
  ``quant_scale_ckr [1, Dr]`` (required for an int8 ``kr_cache``, else None) ``k_r`` is quantized the same way.

Integer products are exact (computed in fp64, which holds every int8 x int8 sum of the supported widths).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..._core.checks import check_tensor, require

WEIGHT_QUANT_MODES = (0, 1, 2)
KV_CACHE_QUANT_MODES = (0, 1, 2)
QUERY_QUANT_MODES = (0, 1)


@dataclass(frozen=True)
class PrologQuant:
    """The quantized mode of one prolog call and its scale tensors (None where the mode takes none)."""
    weight_mode: int = 0
    kv_cache_mode: int = 0
    query_mode: int = 0
    dequant_scale_x: Tensor | None = None
    dequant_scale_w_dq: Tensor | None = None
    dequant_scale_w_uq_qr: Tensor | None = None
    dequant_scale_w_dkv_kr: Tensor | None = None
    quant_scale_ckv: Tensor | None = None
    smooth_scales_cq: Tensor | None = None
    quant_scale_ckr: Tensor | None = None

    def cache_scales(self) -> tuple[Tensor | None, Tensor | None]:
        """``(scale of c_kv, scale of k_r)``, each broadcastable over its rows (None: the cache is not quantized)."""
        if self.kv_cache_mode == 1:
            return self.quant_scale_ckv.reshape(-1)[0], None
        if self.kv_cache_mode == 2:
            ckr = None if self.quant_scale_ckr is None else self.quant_scale_ckr.reshape(-1)
            return self.quant_scale_ckv.reshape(-1), ckr
        return None, None


def unsupported_mode(q: PrologQuant) -> str | None:
    """Why attnops cannot run the mode (a message naming the argument), or None."""
    for name, value, allowed in (("weight_quant_mode", q.weight_mode, WEIGHT_QUANT_MODES),
                                 ("kv_cache_quant_mode", q.kv_cache_mode, KV_CACHE_QUANT_MODES),
                                 ("query_quant_mode", q.query_mode, QUERY_QUANT_MODES)):
        if value not in allowed:
            return (f"{name}: attnops implements modes {list(allowed)} of the MLA prolog (int8 weights, per-tensor "
                    f"int8 KV cache with a per token-head int8 query, per-channel int8 KV cache), got {value!r}; see "
                    f"docs/dsa.md")
    if (q.query_mode == 1) != (q.kv_cache_mode == 1):
        return (f"query_quant_mode: attnops implements the quantized query together with the per-tensor int8 KV "
                f"cache only (query_quant_mode 1 with kv_cache_quant_mode 1), got query_quant_mode={q.query_mode}, "
                f"kv_cache_quant_mode={q.kv_cache_mode}")
    return None


def _scale(name: str, x, shape: tuple[int, ...], needed: bool, mode: str) -> None:
    if not needed:
        require(x is None, name, f"None ({mode})", x)
        return
    check_tensor(name, x, dtypes=(torch.float32, torch.float64))
    require(x.numel() == shape[-1] * (shape[0] if len(shape) > 1 else 1) and x.shape[-1] == shape[-1], name,
            f"shape {list(shape)}", x)


def check_quant(q: PrologQuant, token_x: Tensor, weight_dq: Tensor, weight_uq_qr: Tensor, weight_dkv_kr: Tensor,
                kv_cache: Tensor, kr_cache: Tensor) -> None:
    """Dtypes and scale shapes of a quantized call (named errors)."""
    int8 = (torch.int8,)
    wq, kvq = q.weight_mode, q.kv_cache_mode
    tokens = token_x.shape[:-1].numel()
    if wq >= 1:
        check_tensor("weight_uq_qr", weight_uq_qr, dtypes=int8)
    for name, w in (("token_x", token_x), ("weight_dq", weight_dq), ("weight_dkv_kr", weight_dkv_kr)):
        check_tensor(name, w, dtypes=int8 if wq == 2 else (torch.float16, torch.bfloat16, torch.float32,
                                                             torch.float64))
    mode = f"weight_quant_mode {wq}"
    _scale("dequant_scale_x", q.dequant_scale_x, (tokens, 1), wq == 2, mode)
    _scale("dequant_scale_w_dq", q.dequant_scale_w_dq, (1, weight_dq.shape[1]), wq == 2, mode)
    _scale("dequant_scale_w_dkv_kr", q.dequant_scale_w_dkv_kr, (1, weight_dkv_kr.shape[1]), wq == 2, mode)
    _scale("dequant_scale_w_uq_qr", q.dequant_scale_w_uq_qr, (1, weight_uq_qr.shape[1]), wq >= 1, mode)
    if q.smooth_scales_cq is not None:
        _scale("smooth_scales_cq", q.smooth_scales_cq, (1, weight_dq.shape[1]), wq >= 1, mode)
    mode = f"kv_cache_quant_mode {kvq}"
    hckv = kv_cache.shape[-1]
    if kvq == 1 and wq == 2 and q.quant_scale_ckv is not None and q.quant_scale_ckv.dim() == 2:
        _scale("quant_scale_ckv", q.quant_scale_ckv, (1, hckv), True, mode)  # the NPU reads its first value
    else:
        _scale("quant_scale_ckv", q.quant_scale_ckv, (1,) if kvq == 1 else (1, hckv), kvq >= 1, mode)
    if kvq >= 1:
        check_tensor("kv_cache", kv_cache, dtypes=int8)
    int8_kr = kr_cache.dtype == torch.int8
    require(not int8_kr or kvq == 2, "kr_cache", "a floating-point cache (an int8 kr_cache needs "
            "kv_cache_quant_mode 2, per channel)", kr_cache)
    _scale("quant_scale_ckr", q.quant_scale_ckr, (1, kr_cache.shape[-1]), int8_kr, mode)


def dynamic_int8(x: Tensor, per: int) -> tuple[Tensor, Tensor]:
    """``(codes, scale)``: ``x`` quantized symmetrically over its last ``per`` dims, ``scale = max|x| / 127``
    (keepdim over those dims), ``codes = clamp(round(x / scale))`` in ``x``'s dtype (rows of zeros: scale 0,
    codes 0)."""
    dims = tuple(range(-per, 0))
    scale = x.abs().amax(dim=dims, keepdim=True) / 127
    codes = torch.round(x / scale.masked_fill(scale == 0, 1)).clamp(-128, 127)
    return codes, scale


def int8_matmul(codes: Tensor, weight: Tensor, row_scale: Tensor, col_scale: Tensor, dt: torch.dtype) -> Tensor:
    """``(codes @ weight) * row_scale * col_scale`` with the integer product exact (fp64), in ``dt``."""
    exact = codes.to(torch.float64) @ weight.to(torch.float64)
    return exact.to(dt) * row_scale.to(dt).reshape(-1, 1) * col_scale.to(dt).reshape(1, -1)
