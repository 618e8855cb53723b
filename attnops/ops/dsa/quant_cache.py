"""The packed KV cache of ``npu_kv_quant_sparse_flash_attention``: one-byte rows of 656 bytes per token.

Bytes ``0..511``: the 512 quantized latent (nope) codes (int8, fp8 e4m3fn, or HiFloat8 in one-byte storage);
``512..639``: the 64 rope values in the query's dtype (2 bytes each); ``640..655``: four float32 dequantization
scales, one per 128-wide tile of the codes. ``k_nope[c] = code[c] * scale[c // 128]``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..._core import hifloat8

NOPE_DIM = 512
TILE = 128
ROPE_DIM = 64
ROW_BYTES = NOPE_DIM + 2 * ROPE_DIM + 4 * (NOPE_DIM // TILE)  # 656
CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)
HIF8_STORAGE_DTYPES = (torch.uint8, torch.int8)  # HiFloat8 codes as raw bytes


def unpack_rows(packed: Tensor, rope_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(codes [..., 512], rope [..., 64] in rope_dtype, scales [..., 4] fp32)`` of packed rows ``[..., 656]``."""
    raw = packed.contiguous().view(torch.uint8)
    codes = raw[..., :NOPE_DIM].view(packed.dtype)
    rope = raw[..., NOPE_DIM:NOPE_DIM + 2 * ROPE_DIM].contiguous().view(rope_dtype)
    scales = raw[..., NOPE_DIM + 2 * ROPE_DIM:].contiguous().view(torch.float32)
    return codes, rope, scales


def pack_rows(codes: Tensor, rope: Tensor, scales: Tensor) -> Tensor:
    """The inverse of :func:`unpack_rows`: ``[..., 656]`` rows in ``codes``' dtype."""
    parts = (codes.contiguous().view(torch.uint8), rope.contiguous().view(torch.uint8),
             scales.to(torch.float32).contiguous().view(torch.uint8))
    return torch.cat(parts, -1).view(codes.dtype)


def dequantize(packed: Tensor, rope_dtype: torch.dtype, *, hif8: bool = False) -> tuple[Tensor, Tensor]:
    """``(k_nope [..., 512] fp32, k_rope [..., 64] in rope_dtype)`` of packed rows (``hif8``: the codes are
    HiFloat8 bytes)."""
    codes, rope, scales = unpack_rows(packed, rope_dtype)
    values = hifloat8.decode(codes) if hif8 else codes.to(torch.float32)
    nope = values.unflatten(-1, (-1, TILE)) * scales[..., None]
    return nope.flatten(-2), rope


def quantize(k_nope: Tensor, k_rope: Tensor, code_dtype: torch.dtype = torch.int8) -> Tensor:
    """Packed rows of ``k_nope [..., 512]`` (per-128-tile absmax scales, round half to even) and ``k_rope``."""
    tiles = k_nope.to(torch.float32).unflatten(-1, (-1, TILE))
    top = 127.0 if code_dtype == torch.int8 else torch.finfo(torch.float8_e4m3fn).max
    scales = (tiles.abs().amax(-1) / top).clamp_min(torch.finfo(torch.float32).tiny)
    scaled = tiles / scales[..., None]
    codes = scaled.round().clamp(-128, 127).to(torch.int8) if code_dtype == torch.int8 else scaled.to(code_dtype)
    return pack_rows(codes.flatten(-2), k_rope, scales)


def dequantized_operands(query: Tensor, key: Tensor, rope_dim: int, hif8: bool
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(q_nope, q_rope, k_nope, k_rope)``: the query split at ``D - rope_dim`` and the packed key dequantized
    (nope in the query's dtype, as Huawei's golden rounds it)."""
    d = query.shape[-1] - rope_dim
    k_nope, k_rope = dequantize(key, query.dtype, hif8=hif8)
    return query[..., :d], query[..., d:], k_nope.to(query.dtype), k_rope
