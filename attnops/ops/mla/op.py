"""The MLA helpers as ``torch.library`` custom ops (namespace ``attnops``) with fake kernels; the cache writers
declare the caches they mutate. They run the pure-PyTorch implementations on every device."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..._core.checks import check_same_device, check_tensor, require
from ..._core.custom_ops import register_dry_run_meta
from .kv_cache import check_kv_rmsnorm_rope_cache, kv_rmsnorm_rope_cache
from .prolog import check_prolog, mla_prolog
from .prolog_quant import PrologQuant, check_quant, unsupported_mode
from .rope import interleave_rope

DEVICE_TYPES = ("cpu", "cuda")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@torch.library.custom_op("attnops::mla_interleave_rope", mutates_args=(), device_types=DEVICE_TYPES)
def mla_interleave_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    check_tensor("x", x, ndim=4, dtypes=FLOAT_DTYPES)
    require(x.shape[-1] % 2 == 0, "x", "an even last dim", x)
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, ndim=4, dtypes=(x.dtype,))
        ok = t.shape[0] == x.shape[0] and t.shape[1] == 1 and t.shape[2] in (1, x.shape[2]) and t.shape[3] == x.shape[3]
        require(ok, name, f"[{x.shape[0]}, 1, {x.shape[2]} or 1, {x.shape[3]}]", t)
    check_same_device("x", x, cos=cos, sin=sin)
    return interleave_rope(x, cos, sin).to(x.dtype)


@mla_interleave_rope.register_fake
def _(x, cos, sin):
    return torch.empty_like(x)


@torch.library.custom_op("attnops::mla_kv_rmsnorm_rope_cache", mutates_args=("k_cache", "ckv_cache"),
                         device_types=DEVICE_TYPES)
def mla_kv_rmsnorm_rope_cache(kv: Tensor, gamma: Tensor, cos: Tensor, sin: Tensor, index: Tensor, k_cache: Tensor,
                              ckv_cache: Tensor, k_rope_scale: Optional[Tensor], c_kv_scale: Optional[Tensor],
                              k_rope_offset: Optional[Tensor], c_kv_offset: Optional[Tensor], epsilon: float,
                              cache_mode: str, v: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    check_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, k_rope_scale, c_kv_scale, cache_mode,
                                v)
    return kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, k_rope_scale, c_kv_scale,
                                 k_rope_offset, c_kv_offset, epsilon, cache_mode, v)


@mla_kv_rmsnorm_rope_cache.register_fake
def _(kv, gamma, cos, sin, index, k_cache, ckv_cache, k_rope_scale, c_kv_scale, k_rope_offset, c_kv_offset, epsilon,
      cache_mode, v=None):
    if v is not None:
        return torch.empty_like(kv), torch.empty_like(v)
    dc = gamma.shape[-1]
    return kv.new_empty((*kv.shape[:-1], kv.shape[-1] - dc)), kv.new_empty((*kv.shape[:-1], dc))


@torch.library.custom_op("attnops::mla_prolog", mutates_args=("kv_cache", "kr_cache"), device_types=DEVICE_TYPES)
def mla_prolog_op(token_x: Tensor, weight_dq: Tensor, weight_uq_qr: Tensor, weight_uk: Tensor,
                  weight_dkv_kr: Tensor, rmsnorm_gamma_cq: Tensor, rmsnorm_gamma_ckv: Tensor, rope_sin: Tensor,
                  rope_cos: Tensor, kv_cache: Tensor, kr_cache: Tensor, cache_index: Optional[Tensor],
                  actual_seq_len: Optional[Tensor], rmsnorm_epsilon_cq: float, rmsnorm_epsilon_ckv: float,
                  cache_mode: str, qc_qr_scale: float, kc_scale: float, dequant_scale_x: Optional[Tensor] = None,
                  dequant_scale_w_dq: Optional[Tensor] = None, dequant_scale_w_uq_qr: Optional[Tensor] = None,
                  dequant_scale_w_dkv_kr: Optional[Tensor] = None, quant_scale_ckv: Optional[Tensor] = None,
                  smooth_scales_cq: Optional[Tensor] = None, weight_quant_mode: int = 0, kv_cache_quant_mode: int = 0,
                  query_quant_mode: int = 0, quant_scale_ckr: Optional[Tensor] = None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(query, query_rope, dequant_scale_q_nope, query_norm, dequant_scale_q_norm)``; the caches are written in
    place (quantized modes: :mod:`.prolog_quant`)."""
    quant = PrologQuant(weight_quant_mode, kv_cache_quant_mode, query_quant_mode, dequant_scale_x, dequant_scale_w_dq,
                        dequant_scale_w_uq_qr, dequant_scale_w_dkv_kr, quant_scale_ckv, smooth_scales_cq,
                        quant_scale_ckr)
    reason = unsupported_mode(quant)
    if reason is not None:
        raise NotImplementedError(reason)
    check_prolog(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq, rmsnorm_gamma_ckv,
                 rope_sin, rope_cos, kv_cache, kr_cache, cache_index, cache_mode)
    check_quant(quant, token_x, weight_dq, weight_uq_qr, weight_dkv_kr, kv_cache, kr_cache)
    return mla_prolog(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
                      rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache, kr_cache, cache_index, actual_seq_len,
                      rmsnorm_epsilon_cq, rmsnorm_epsilon_ckv, cache_mode, qc_qr_scale, kc_scale, quant)


@mla_prolog_op.register_fake
def _(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq, rmsnorm_gamma_ckv, rope_sin,
      rope_cos, kv_cache, kr_cache, cache_index, actual_seq_len, rmsnorm_epsilon_cq, rmsnorm_epsilon_ckv, cache_mode,
      qc_qr_scale, kc_scale, dequant_scale_x=None, dequant_scale_w_dq=None, dequant_scale_w_uq_qr=None,
      dequant_scale_w_dkv_kr=None, quant_scale_ckv=None, smooth_scales_cq=None, weight_quant_mode=0,
      kv_cache_quant_mode=0, query_quant_mode=0, quant_scale_ckr=None):
    n, d, hckv = weight_uk.shape
    lead = token_x.shape[:-1]
    tokens = lead.numel()
    dr = weight_uq_qr.shape[1] // n - d
    out = token_x.dtype if token_x.is_floating_point() else rope_cos.dtype
    scale = (lambda *shape: token_x.new_empty(shape, dtype=torch.float32))
    return (token_x.new_empty((*lead, n, hckv), dtype=torch.int8 if query_quant_mode == 1 else out),
            token_x.new_empty((*lead, n, dr), dtype=out), scale(tokens, n, 1) if query_quant_mode == 1 else scale(0),
            token_x.new_empty((*lead, weight_dq.shape[1]), dtype=torch.int8 if weight_quant_mode >= 1 else out),
            scale(tokens, 1) if weight_quant_mode >= 1 else scale(0))


for _op in (mla_interleave_rope, mla_kv_rmsnorm_rope_cache, mla_prolog_op):
    register_dry_run_meta(_op)
