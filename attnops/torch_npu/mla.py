"""torch_npu's MLA helpers: ``npu_interleave_rope``, ``npu_kv_rmsnorm_rope_cache`` (every cache mode, NZ and int8
caches, V1 and V2) and ``npu_mla_prolog_v3`` / ``_v3_functional`` / ``_v2`` (non-quantized and int8 paths; the
mxfp8 / fp8 / hifloat8 weights and per-tile caches raise :class:`NotImplementedError` naming the argument). They
call the ``attnops::mla_*`` custom ops."""
from __future__ import annotations

import torch

from .._core.checks import check_tensor
from .._core.custom_ops import call
from ..ops.mla import op as mla_op
from ._common import reject_unsupported


def npu_interleave_rope(x, cos, sin):
    """``x [B, N, S, Dr]`` rotated pairwise by ``cos``/``sin [B, 1, S or 1, Dr]``, output de-interleaved (evens
    rotated first, then odds), in x's dtype."""
    return call(mla_op.mla_interleave_rope, x, cos, sin)


def npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, k_rope_scale=None, c_kv_scale=None,
                              k_rope_offset=None, c_kv_offset=None, v=None, epsilon=1e-5, cache_mode="Norm",
                              is_output_kv=False):
    """``(k_cache, ckv_cache, k_embed_out [B, 1, S, Dr], y_out [B, 1, S, Dc])``: RMSNorm of ``kv[..., :Dc]`` into
    ``ckv_cache`` and RoPE of the rest into ``k_cache`` (both written in place and returned). With ``v [B, N, S, Dv]``
    (V2): RMSNorm of all of ``kv [B, N, S, Dk]`` with its first ``Dr`` dims rotated into ``k_cache`` and ``v`` into
    ``ckv_cache``; the outputs are then those rows ``[B, N, S, Dk]`` and ``v``."""
    k_embed, y = call(mla_op.mla_kv_rmsnorm_rope_cache, kv, gamma, cos, sin, index, k_cache, ckv_cache, k_rope_scale,
                      c_kv_scale, k_rope_offset, c_kv_offset, float(epsilon), cache_mode, v)
    return k_cache, ckv_cache, k_embed, y


def _prolog(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq, rmsnorm_gamma_ckv,
            rope_sin, rope_cos, kv_cache, kr_cache, cache_index, actual_seq_len, rmsnorm_epsilon_cq,
            rmsnorm_epsilon_ckv, cache_mode, qc_qr_scale=1.0, kc_scale=1.0, **quant):
    return call(mla_op.mla_prolog_op, token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
                rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache, kr_cache, cache_index, actual_seq_len,
                float(rmsnorm_epsilon_cq), float(rmsnorm_epsilon_ckv), cache_mode, float(qc_qr_scale),
                float(kc_scale), quant.get("dequant_scale_x"), quant.get("dequant_scale_w_dq"),
                quant.get("dequant_scale_w_uq_qr"), quant.get("dequant_scale_w_dkv_kr"), quant.get("quant_scale_ckv"),
                quant.get("smooth_scales_cq"), int(quant.get("weight_quant_mode", 0)),
                int(quant.get("kv_cache_quant_mode", 0)), int(quant.get("query_quant_mode", 0)),
                quant.get("quant_scale_ckr"))


def _reject_repo_modes(**modes) -> None:
    for name, value in modes.items():
        if value:
            raise NotImplementedError(f"{name}: attnops implements separate kv/kr caches and scales only (expected 0, "
                                      f"got {value!r}); see docs/dsa.md")


def npu_mla_prolog_v3(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
                      rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache, kr_cache, *, cache_index=None,
                      dequant_scale_x=None, dequant_scale_w_dq=None, dequant_scale_w_uq_qr=None,
                      dequant_scale_w_dkv_kr=None, quant_scale_ckv=None, quant_scale_ckr=None, smooth_scales_cq=None,
                      actual_seq_len=None, k_nope_clip_alpha=None, rmsnorm_epsilon_cq=1e-05,
                      rmsnorm_epsilon_ckv=1e-05, cache_mode="PA_BSND", query_norm_flag=False, weight_quant_mode=0,
                      kv_cache_quant_mode=0, query_quant_mode=0, ckvkr_repo_mode=0, quant_scale_repo_mode=0,
                      tile_size=128, qc_qr_scale=1.0, kc_scale=1.0, token_x_dtype=None, weight_dq_dtype=None,
                      weight_uq_qr_dtype=None, weight_dkv_kr_dtype=None, kv_cache_dtype=None):
    """``(query [.., N, Hckv], query_rope [.., N, Dr], dequant_scale_q_nope ([T, N, 1] with query_quant_mode 1, else
    [0]), query_norm ([.., Hcq] when query_norm_flag, else [0]), dequant_scale_q_norm ([T, 1] when query_norm_flag
    and the weights are int8, else [0]))``; ``kv_cache``/``kr_cache`` written in place."""
    _reject_repo_modes(ckvkr_repo_mode=ckvkr_repo_mode, quant_scale_repo_mode=quant_scale_repo_mode)
    reject_unsupported(k_nope_clip_alpha=k_nope_clip_alpha)
    query, query_rope, scale_q, query_norm, scale_norm = _prolog(
        token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq, rmsnorm_gamma_ckv, rope_sin,
        rope_cos, kv_cache, kr_cache, cache_index, actual_seq_len, rmsnorm_epsilon_cq, rmsnorm_epsilon_ckv,
        cache_mode, qc_qr_scale, kc_scale, dequant_scale_x=dequant_scale_x, dequant_scale_w_dq=dequant_scale_w_dq,
        dequant_scale_w_uq_qr=dequant_scale_w_uq_qr, dequant_scale_w_dkv_kr=dequant_scale_w_dkv_kr,
        quant_scale_ckv=quant_scale_ckv, quant_scale_ckr=quant_scale_ckr, smooth_scales_cq=smooth_scales_cq,
        weight_quant_mode=weight_quant_mode, kv_cache_quant_mode=kv_cache_quant_mode,
        query_quant_mode=query_quant_mode)
    if not query_norm_flag:
        query_norm, scale_norm = token_x.new_empty((0,), dtype=query_norm.dtype), scale_norm[:0]
    return query, query_rope, scale_q, query_norm, scale_norm


def npu_mla_prolog_v3_functional(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
                                 rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache, kr_cache, **kwargs):
    """The out-of-place twin of :func:`npu_mla_prolog_v3`: the caches are copied, written and returned as well
    (7 outputs: query, query_rope, dequant_scale_q_nope, query_norm, dequant_scale_q_norm, kv_cache, kr_cache)."""
    check_tensor("kv_cache", kv_cache)
    check_tensor("kr_cache", kr_cache)
    kv_out, kr_out = kv_cache.clone(), kr_cache.clone()
    outs = npu_mla_prolog_v3(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
                             rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_out, kr_out, **kwargs)
    return (*outs, kv_out, kr_out)


def npu_mla_prolog_v2(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
                      rmsnorm_gamma_ckv, rope_sin, rope_cos, cache_index, kv_cache, kr_cache, *,
                      dequant_scale_x=None, dequant_scale_w_dq=None, dequant_scale_w_uq_qr=None,
                      dequant_scale_w_dkv_kr=None, quant_scale_ckv=None, quant_scale_ckr=None, smooth_scales_cq=None,
                      rmsnorm_epsilon_cq=1e-05, rmsnorm_epsilon_ckv=1e-05, cache_mode="PA_BSND"):
    """``(query, query_rope, kv_cache, kr_cache, dequant_scale_q_nope)`` (the caches also written in place). The
    mode follows the dtypes: int8 ``weight_uq_qr`` ("partial", also int8 ``token_x``: "full", W8A8). An int8
    ``kv_cache`` is per-tensor in the full mode (``quant_scale_ckv [1]`` or ``[1, Hckv]``, its first value read;
    the query is quantized too, ``dequant_scale_q_nope [T, N, 1]``; else ``[1]``) and per-channel otherwise
    (``quant_scale_ckv [1, Hckv]``; an int8 ``kr_cache`` with ``quant_scale_ckr [1, Dr]``)."""
    for name, x in (("token_x", token_x), ("weight_uq_qr", weight_uq_qr), ("kv_cache", kv_cache)):
        check_tensor(name, x)  # their dtypes pick the mode
    weight_mode = 0 if weight_uq_qr.dtype != torch.int8 else 2 if token_x.dtype == torch.int8 else 1
    int8_cache = kv_cache.dtype == torch.int8
    full = int(int8_cache and weight_mode == 2)
    kv_quant_mode = 0 if not int8_cache else 1 if full else 2  # per-tensor with W8A8, else per-channel
    query, query_rope, scale_q, _, _ = _prolog(
        token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq, rmsnorm_gamma_ckv, rope_sin,
        rope_cos, kv_cache, kr_cache, cache_index, None, rmsnorm_epsilon_cq, rmsnorm_epsilon_ckv, cache_mode,
        dequant_scale_x=dequant_scale_x, dequant_scale_w_dq=dequant_scale_w_dq,
        dequant_scale_w_uq_qr=dequant_scale_w_uq_qr, dequant_scale_w_dkv_kr=dequant_scale_w_dkv_kr,
        quant_scale_ckv=quant_scale_ckv, quant_scale_ckr=quant_scale_ckr, smooth_scales_cq=smooth_scales_cq,
        weight_quant_mode=weight_mode, kv_cache_quant_mode=kv_quant_mode, query_quant_mode=full)
    return query, query_rope, kv_cache, kr_cache, scale_q if full else query_rope.new_zeros((1,),
                                                                                             dtype=torch.float32)
