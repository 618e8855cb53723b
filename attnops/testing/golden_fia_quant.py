"""The quantized values of the FIA golden: int8 saturation, int4 packing, the ``npu_trans_quant_param`` encoding of
deq scales, and the antiquant of int8/int4 key/value in every mode of the seed (independent of ``attnops._core``)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
from torch import Tensor


def sat_int8(x: Tensor) -> Tensor:
    """Round half to even and saturate to [-128, 127] (values stay in x's dtype)."""
    return torch.clamp(torch.round(x), -128, 127)


def pack_int4(x: Tensor) -> Tensor:
    """int values in [-8, 7], last dim a multiple of 8 -> int32 with element 8k+e in bits 4e..4e+3 of word k."""
    if x.shape[-1] % 8:
        raise ValueError("last dim must be a multiple of 8")
    v = x.to(torch.int64)
    if bool(((v < -8) | (v > 7)).any()):
        raise ValueError("int4 values must be in [-8, 7]")
    nib = (v & 0xF).reshape(*x.shape[:-1], x.shape[-1] // 8, 8)
    word = torch.zeros(nib.shape[:-1], dtype=torch.int64)
    for e in range(8):
        word |= nib[..., e] << (4 * e)
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word)  # two's complement int32
    return word.to(torch.int32)


def unpack_int4(x: Tensor) -> Tensor:
    """int32 words -> int64 values, last dim times 8; element 0 in bits 0-3, two's-complement nibbles."""
    w = x.to(torch.int64) & 0xFFFFFFFF
    nibs = [(w >> (4 * e)) & 0xF for e in range(8)]
    v = torch.stack(nibs, dim=-1)
    v = torch.where(v >= 8, v - 16, v)
    return v.reshape(*x.shape[:-1], x.shape[-1] * 8)


def _f32_bits(f: float) -> int:
    return struct.unpack("<I", struct.pack("<f", f))[0]


def _bits_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def encode_deq_scale(scale: float, dtype=torch.uint64) -> Tensor:
    """``npu_trans_quant_param`` of one fp32 scale: ``(fp32_bits & 0xFFFFE000) | (1 << 46)``, shape [1]."""
    return torch.tensor([(_f32_bits(scale) & 0xFFFFE000) | (1 << 46)], dtype=dtype)


def decode_deq_scale(x: Tensor) -> float:
    """Per-tensor deq scale: UINT64/INT64 = the trans-quant encoding (low 32 bits, truncated to 19 bits);
    FLOAT32 (or any float) as given."""
    if x.numel() != 1:
        raise ValueError(f"deq scales are per-tensor, got shape {tuple(x.shape)}")
    if x.dtype.is_floating_point:
        return float(x.reshape(-1)[0])
    v = int(x.reshape(-1).tolist()[0])
    return _bits_f32((v & 0xFFFFFFFF) & 0xFFFFE000)


def integer_values(x) -> Tensor:
    """int8/int32 (int4-packed) tensor -> integer values as int64 (int32 is unpacked, last dim x8)."""
    if x.dtype == torch.int32:
        return unpack_int4(x)
    return x.to(torch.int64)


def is_quantized(x: Tensor) -> bool:
    return x.dtype in (torch.int8, torch.int32)


# ------------------------------------------------------------------------------------------------ antiquant
@dataclass
class Antiquant:
    """One tensor's dequantization: ``mode`` of the separate-parameter table (0..5), scale, optional offset."""
    mode: int
    scale: Tensor
    offset: Tensor | None


def antiquant_specs(antiquant_scale, antiquant_offset, antiquant_mode, key_antiquant_scale,
                     key_antiquant_offset, value_antiquant_scale, value_antiquant_offset, key_antiquant_mode,
                     value_antiquant_mode):
    """(key spec, value spec); the separate K/V parameters win over the combined ones."""
    if key_antiquant_scale is not None or value_antiquant_scale is not None:
        return (Antiquant(key_antiquant_mode, key_antiquant_scale, key_antiquant_offset),
                Antiquant(value_antiquant_mode, value_antiquant_scale, value_antiquant_offset))
    if antiquant_scale is None:
        return None, None
    if antiquant_mode not in (0, 1):
        raise ValueError(f"antiquant_mode must be 0 or 1, got {antiquant_mode}")
    specs = []
    for idx in (0, 1):  # index 0 = key, 1 = value
        sc = antiquant_scale[idx]
        off = None if antiquant_offset is None else antiquant_offset[idx]
        if antiquant_mode == 0:
            specs.append(Antiquant(0, sc.reshape(-1) if sc.dim() == 0 else sc, off))
        else:  # per-token (B, S)
            specs.append(Antiquant(1, sc, off))
    return specs[0], specs[1]


def _aq_factor(t: Tensor | None, mode: int, *, b: int, nkv: int, d: int, pos: Tensor, blocks, dtype) -> Tensor:
    """The scale (or offset) broadcastable to [N, S, D] for tokens at per-token positions ``pos`` [S].

    ``blocks``: (block ids, in-block offsets) of the tokens for the page-managed modes 4/5.
    """
    if t is None:
        return torch.zeros((), dtype=dtype)
    t = t.to(dtype)
    if mode == 0:  # per-channel (N, D) in any documented shape, or per-tensor
        if t.numel() == 1:
            return t.reshape(())
        if t.numel() != nkv * d:
            raise ValueError(f"per-channel antiquant parameter has {t.numel()} elements, need N*D={nkv * d}")
        return t.reshape(nkv, 1, d)
    if mode == 1:  # per-token (1, B, S) / (B, S)
        s = t.reshape(-1, t.shape[-1])[b]
        return s[pos].reshape(1, -1, 1)
    if mode == 2:  # per-tensor + per-head (N)
        return t.reshape(nkv, 1, 1)
    if mode == 3:  # per-token + per-head (B, N, S)
        return t[b][:, pos].reshape(nkv, -1, 1)
    if mode in (4, 5):  # page-managed per-token (blocknum, bs) / + per-head (blocknum, N, bs)
        if blocks is None:
            raise ValueError(f"antiquant mode {mode} needs a block table")
        blk, off = blocks
        if mode == 4:
            return t[blk, off].reshape(1, -1, 1)
        return t[blk, :, off].transpose(0, 1).reshape(nkv, -1, 1)
    raise ValueError(f"antiquant mode must be in 0..5, got {mode}")


def dequant(x: Tensor, spec: Antiquant | None, *, b, nkv, pos, blocks, dtype) -> Tensor:
    """Integer x [N, S, D] -> (x + offset) * scale in ``dtype``."""
    if spec is None:
        raise ValueError("int8/int4 key/value with a float query need antiquant scales")
    d = x.shape[-1]
    sc = _aq_factor(spec.scale, spec.mode, b=b, nkv=nkv, d=d, pos=pos, blocks=blocks, dtype=dtype)
    off = _aq_factor(spec.offset, spec.mode, b=b, nkv=nkv, d=d, pos=pos, blocks=blocks, dtype=dtype)
    return (x.to(dtype) + off) * sc
