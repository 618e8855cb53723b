"""The quantised lightning indexer's inputs (vllm-ascend's ``npu_vllm_quant_lightning_indexer``): int8 (A2/A3) or
fp8 e4m3 (Ascend 950) query and compressed keys with per-token-head dequantisation scales (quant mode 0):
``query_dequant_scale`` ``[.., N1]`` (query's shape without D), ``key_dequant_scale`` ``[.., 1]`` (key's shape without
D). The published score is ``sum_h w_h * relu(sq_h * sk_j * (q_h . k_j))``, which is the unquantised score of the
dequantised ``q * sq`` and ``k * sk``; this module validates and dequantises, the indexer does the rest. Other quant
modes have no public math."""
from __future__ import annotations

import torch
from torch import Tensor

from ..._core.checks import check_int, check_same_device, check_tensor

CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
QUANT_MODES = {0: "per-token-head"}


def _check_mode(name: str, mode: int) -> None:
    check_int(name, mode)
    if mode not in QUANT_MODES:
        raise NotImplementedError(f"{name}={mode}: only mode 0 (per-token-head dequantisation scales) has public "
                                  f"math; mode {mode} is not implemented")


def dequantize_indexer_inputs(query: Tensor, key: Tensor, weights: Tensor, query_dequant_scale: Tensor,
                              key_dequant_scale: Tensor, *, query_quant_mode: int, key_quant_mode: int
                              ) -> tuple[Tensor, Tensor, Tensor]:
    """``(query * scale, key * scale, weights)`` in fp32, after checking the codes' dtypes, the modes, the weights'
    dtype and the scales' shapes (the indexer checks the rest)."""
    _check_mode("query_quant_mode", query_quant_mode)
    _check_mode("key_quant_mode", key_quant_mode)
    check_same_device("query", query, key=key, weights=weights, query_dequant_scale=query_dequant_scale,
                      key_dequant_scale=key_dequant_scale)
    check_tensor("query", query, dtypes=CODE_DTYPES, ndim=(3, 4))
    check_tensor("key", key, dtypes=(query.dtype,), ndim=(3, 4))
    check_tensor("query_dequant_scale", query_dequant_scale, dtypes=SCALE_DTYPES, shape=tuple(query.shape[:-1]))
    check_tensor("key_dequant_scale", key_dequant_scale, dtypes=SCALE_DTYPES, shape=tuple(key.shape[:-1]))
    check_tensor("weights", weights, dtypes=SCALE_DTYPES)
    q = query.to(torch.float32) * query_dequant_scale.to(torch.float32)[..., None]
    k = key.to(torch.float32) * key_dequant_scale.to(torch.float32)[..., None]
    return q, k, weights.to(torch.float32)
