"""Dense golden of CANN FusedInferAttentionScoreV2 (FIA), written straight from the spec.

Sources: the seed ``aclnnFusedInferAttentionScoreV2.md`` (parameters and constraints), ``cann_semantics.md``
§1.2 (inference masks) and §6 (FIA), and ``DECISIONS.md`` (FIA section; it wins). This module does not import
``attnops.ops`` or ``attnops._core``: it is an independent judge.

Everything is computed in the ``dtype`` argument: float64 for the golden, float16/bfloat16 for the "plain PyTorch
in low precision" baseline of the tolerance rule (``attnops.testing.compare``). One loop over the batches, one
dense ``[N, Sq_b, Skv_b]`` score matrix per batch:

1. K/V are gathered (dense tensor, list of per-batch tensors, or pages of a block table; the cache layouts
   ``(blocknum, blocksize, H)``, ``(blocknum, KV_N, blocksize, D)`` and NZ ``(blocknum, KV_N, D/x, blocksize, x)``),
   int4 (int32-packed) is unpacked and int8 / int4 K/V are dequantized as ``(x + offset) * scale`` (every antiquant
   mode of the seed).
2. The valid query rows / KV columns of each batch follow the actual lengths and the left padding of §6.4; the
   shared prefix (first ``actual_shared_prefix_len`` rows) is placed before each batch's keys.
3. keep(i, j) from the sparse-mode table of §1.2 (modes 0-4, pre/next converted with the actual lengths, prefix
   included); Q_S = 1 ignores sparse_mode/pre/next and uses the ``(B, KV_S)`` mask.
   Masks and pse are indexed in physical coordinates: query row ``q_start + i``; key column ``j`` for the prefix
   part and ``L + kv_start + (j - L)`` after it (paged KV: the logical token position).
4. ``S = scale * Q K^T + pse`` (mul then add), masked scores are ``-inf``, ``P~ = exp(S - max)``,
   ``out = (P~ @ V) / sum(P~)``, ``lse = max + log(sum)``.
   Int8 Q/K/V (§6.7): ``S = (Q_i8 @ K_i8^T) * deq_scale1``, ``P_i8 = sat_int8(round_half_even(P~ * quant_scale1))``,
   ``out = (P_i8 @ V_i8) * deq_scale2 / sum(P~)``.
5. Rows with nothing to attend to (fully masked, empty KV, and for Q_S = 1 a KV left-padding start before 0) give
   output 0 and lse ``+inf``. Query rows outside the actual length (right or left padding) are not computed:
   output 0 and lse ``+inf`` (project convention of this golden; tests that depend on it say so).
6. Int8 output: ``sat_int8(round_half_even(out * quant_scale2 + quant_offset2))``, per-tensor or per-channel.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch
from torch import Tensor

from .golden import _to_bnsd

INT_MAX = 2147483647

__all__ = ["fia_forward", "fia_forward_detail", "FiaGolden", "pack_int4", "unpack_int4", "encode_deq_scale",
           "decode_deq_scale", "sat_int8", "per_batch"]


# ----------------------------------------------------------------------------------------------- small helpers
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


def per_batch(lengths, b: int, default: int | list[int], name: str) -> list[int]:
    """Per-batch list of length ``b`` under the seed's broadcast rule (length 1: shared; >= B: first B)."""
    if lengths is None:
        return list(default) if isinstance(default, list) else [int(default)] * b
    vals = [int(v) for v in (lengths.tolist() if isinstance(lengths, Tensor) else lengths)]
    if len(vals) == 1:
        return vals * b
    if len(vals) >= b:
        return vals[:b]
    raise ValueError(f"{name} must have length 1 or >= B={b}, got {len(vals)}")


def _cum_to_lens(cum) -> list[int]:
    vals = [int(v) for v in (cum.tolist() if isinstance(cum, Tensor) else cum)]
    out, prev = [], 0
    for v in vals:
        if v < prev:
            raise ValueError(f"cumulative lengths must be non-decreasing, got {vals}")
        out.append(v - prev)
        prev = v
    return out


def _scalar_int(x) -> int:
    if isinstance(x, Tensor):
        return int(x.reshape(-1)[0])
    if isinstance(x, (list, tuple)):
        return int(x[0])
    return int(x)


def _ints(x) -> Tensor:
    """int8/int32 (int4-packed) tensor -> integer values as int64 (int32 is unpacked, last dim x8)."""
    if x.dtype == torch.int32:
        return unpack_int4(x)
    return x.to(torch.int64)


def _is_quant(x: Tensor) -> bool:
    return x.dtype in (torch.int8, torch.int32)


# ------------------------------------------------------------------------------------------------ layouts
def _layouts(input_layout: str) -> tuple[str, str]:
    if input_layout == "BNSD_BSND":
        return "BNSD", "BSND"
    if input_layout in ("BSH", "BSND", "BNSD", "TND"):
        return input_layout, input_layout
    raise ValueError(f"input_layout must be BSH, BSND, BNSD, BNSD_BSND or TND, got {input_layout!r}")


# ------------------------------------------------------------------------------------------------ antiquant
@dataclass
class _AQ:
    """One tensor's dequantization: ``mode`` of the separate-parameter table (0..5), scale, optional offset."""
    mode: int
    scale: Tensor
    offset: Tensor | None


def _antiquant_specs(antiquant_scale, antiquant_offset, antiquant_mode, key_antiquant_scale,
                     key_antiquant_offset, value_antiquant_scale, value_antiquant_offset, key_antiquant_mode,
                     value_antiquant_mode):
    """(key spec, value spec); the separate K/V parameters win over the combined ones."""
    if key_antiquant_scale is not None or value_antiquant_scale is not None:
        return (_AQ(key_antiquant_mode, key_antiquant_scale, key_antiquant_offset),
                _AQ(value_antiquant_mode, value_antiquant_scale, value_antiquant_offset))
    if antiquant_scale is None:
        return None, None
    if antiquant_mode not in (0, 1):
        raise ValueError(f"antiquant_mode must be 0 or 1, got {antiquant_mode}")
    specs = []
    for idx in (0, 1):  # index 0 = key, 1 = value
        sc = antiquant_scale[idx]
        off = None if antiquant_offset is None else antiquant_offset[idx]
        if antiquant_mode == 0:
            specs.append(_AQ(0, sc.reshape(-1) if sc.dim() == 0 else sc, off))
        else:  # per-token (B, S)
            specs.append(_AQ(1, sc, off))
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


def _dequant(x: Tensor, spec: _AQ | None, *, b, nkv, pos, blocks, dtype) -> Tensor:
    """Integer x [N, S, D] -> (x + offset) * scale in ``dtype``."""
    if spec is None:
        raise ValueError("int8/int4 key/value with a float query need antiquant scales")
    d = x.shape[-1]
    sc = _aq_factor(spec.scale, spec.mode, b=b, nkv=nkv, d=d, pos=pos, blocks=blocks, dtype=dtype)
    off = _aq_factor(spec.offset, spec.mode, b=b, nkv=nkv, d=d, pos=pos, blocks=blocks, dtype=dtype)
    return (x.to(dtype) + off) * sc


# ------------------------------------------------------------------------------------------------ the golden
@dataclass
class FiaGolden:
    """``out`` (query layout, or BSND for BNSD_BSND), ``lse`` ([B,N,Q_S,1] / [T,N,1], or zeros(1) without
    softmax_lse_flag) and, for int8 outputs, ``out_real``: the value before rounding, ``out*qs2 + qo2``
    (0 in rows that are not computed)."""
    out: Tensor
    lse: Tensor
    out_real: Tensor | None


def fia_forward(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                actual_seq_lengths_kv=None, deq_scale1=None, quant_scale1=None, deq_scale2=None, quant_scale2=None,
                quant_offset2=None, antiquant_scale=None, antiquant_offset=None, block_table=None,
                query_padding_size=None, kv_padding_size=None, key_antiquant_scale=None,
                key_antiquant_offset=None, value_antiquant_scale=None, value_antiquant_offset=None,
                key_shared_prefix=None, value_shared_prefix=None, actual_shared_prefix_len=None, num_heads=1,
                scale_value=1.0, pre_tokens=INT_MAX, next_tokens=INT_MAX, input_layout="BSH",
                num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0, antiquant_mode=0,
                softmax_lse_flag=False, key_antiquant_mode=0, value_antiquant_mode=0, dtype=torch.float64):
    """Dense FIA golden: returns ``(attention_out, softmax_lse)`` computed in ``dtype``.

    Integer outputs (int8 output quantization) are returned as integral values in ``dtype``. ``softmax_lse`` is
    ``torch.zeros(1)`` when ``softmax_lse_flag`` is False (the seed's return for a null softmaxLse).
    ``inner_precise`` has no effect: the invalid-row rule is always applied (DECISIONS.md).
    """
    g = fia_forward_detail(
        query, key, value, pse_shift=pse_shift, atten_mask=atten_mask, actual_seq_lengths=actual_seq_lengths,
        actual_seq_lengths_kv=actual_seq_lengths_kv, deq_scale1=deq_scale1, quant_scale1=quant_scale1,
        deq_scale2=deq_scale2, quant_scale2=quant_scale2, quant_offset2=quant_offset2,
        antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset, block_table=block_table,
        query_padding_size=query_padding_size, kv_padding_size=kv_padding_size,
        key_antiquant_scale=key_antiquant_scale, key_antiquant_offset=key_antiquant_offset,
        value_antiquant_scale=value_antiquant_scale, value_antiquant_offset=value_antiquant_offset,
        key_shared_prefix=key_shared_prefix, value_shared_prefix=value_shared_prefix,
        actual_shared_prefix_len=actual_shared_prefix_len, num_heads=num_heads, scale_value=scale_value,
        pre_tokens=pre_tokens, next_tokens=next_tokens, input_layout=input_layout,
        num_key_value_heads=num_key_value_heads, sparse_mode=sparse_mode, inner_precise=inner_precise,
        block_size=block_size, antiquant_mode=antiquant_mode, softmax_lse_flag=softmax_lse_flag,
        key_antiquant_mode=key_antiquant_mode, value_antiquant_mode=value_antiquant_mode, dtype=dtype)
    return g.out, g.lse


def fia_forward_detail(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                       actual_seq_lengths_kv=None, deq_scale1=None, quant_scale1=None, deq_scale2=None,
                       quant_scale2=None, quant_offset2=None, antiquant_scale=None, antiquant_offset=None,
                       block_table=None, query_padding_size=None, kv_padding_size=None, key_antiquant_scale=None,
                       key_antiquant_offset=None, value_antiquant_scale=None, value_antiquant_offset=None,
                       key_shared_prefix=None, value_shared_prefix=None, actual_shared_prefix_len=None,
                       num_heads=1, scale_value=1.0, pre_tokens=INT_MAX, next_tokens=INT_MAX, input_layout="BSH",
                       num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0, antiquant_mode=0,
                       softmax_lse_flag=False, key_antiquant_mode=0, value_antiquant_mode=0,
                       dtype=torch.float64) -> FiaGolden:
    """:func:`fia_forward` returning :class:`FiaGolden` (with the unrounded int8-output value)."""
    del inner_precise  # no numerical effect (DECISIONS.md: invalid rows always give 0 / +inf)
    in_layout, out_layout = _layouts(input_layout)
    stat_dtype = torch.promote_types(dtype, torch.float32)
    n = int(num_heads)
    nkv = int(num_key_value_heads) or n
    if n % nkv:
        raise ValueError(f"num_heads={n} is not a multiple of num_key_value_heads={nkv}")
    grp = n // nkv
    full_quant = query.dtype == torch.int8
    if full_quant and (deq_scale1 is None or quant_scale1 is None or deq_scale2 is None):
        raise ValueError("int8 query needs deq_scale1, quant_scale1 and deq_scale2")
    keys = list(key) if isinstance(key, (list, tuple)) else key
    values = list(value) if isinstance(value, (list, tuple)) else value
    if isinstance(keys, list) and len(keys) == 1:  # a TensorList of one tensor is the contiguous case
        keys, values = keys[0], values[0]
    paged = block_table is not None
    k_spec, v_spec = _antiquant_specs(antiquant_scale, antiquant_offset, antiquant_mode, key_antiquant_scale,
                                      key_antiquant_offset, value_antiquant_scale, value_antiquant_offset,
                                      key_antiquant_mode, value_antiquant_mode)

    # ---- query: per batch [N, rows, D] plus the physical offset of its first valid row
    if in_layout == "TND":
        q_lens = _cum_to_lens(actual_seq_lengths)
        bsz = len(q_lens)
        q_tok = query.shape[0]
        q_off = [sum(q_lens[:b]) for b in range(bsz)]
        q_rows = [query[o:o + s].permute(1, 0, 2) for o, s in zip(q_off, q_lens)]
        q_start = [0] * bsz
        qs_dim = None
        d = query.shape[-1]
        ifa = False
    else:
        d = query.shape[-1] // n if in_layout == "BSH" else query.shape[-1]
        q4 = _to_bnsd(query, in_layout, n)
        if q4.shape[1] != n:
            raise ValueError(f"num_heads={n} does not match the query's {q4.shape[1]} heads")
        bsz, qs_dim = q4.shape[0], q4.shape[2]
        ifa = qs_dim == 1
        if ifa:
            q_lens, q_start = [1] * bsz, [0] * bsz
        else:
            q_lens = per_batch(actual_seq_lengths, bsz, qs_dim, "actual_seq_lengths")
            if query_padding_size is not None and actual_seq_lengths is not None:
                pad = max(0, _scalar_int(query_padding_size))
                q_start = [qs_dim - pad - a for a in q_lens]
            else:
                q_start = [0] * bsz
        for b in range(bsz):
            if q_start[b] < 0 or q_start[b] + q_lens[b] > qs_dim:
                raise ValueError(f"batch {b}: query rows [{q_start[b]}, {q_start[b] + q_lens[b]}) outside "
                                 f"[0, {qs_dim})")
        q_rows = [q4[b, :, q_start[b]:q_start[b] + q_lens[b]] for b in range(bsz)]

    # ---- key/value: per batch physical [N, S, D] (integer values kept as int64 until dequantization)
    def kv_raw(x):
        return _ints(x) if _is_quant(x) else x

    blocks_of = [None] * bsz
    if paged:
        bs = int(block_size) if block_size else keys.shape[1 if keys.dim() == 3 else keys.dim() - 2]
        kv_lens = per_batch(actual_seq_lengths_kv, bsz, 0, "actual_seq_lengths_kv")
        if actual_seq_lengths_kv is None:
            raise ValueError("paged KV needs actual_seq_lengths_kv")
        kc, vc = kv_raw(keys), kv_raw(values)
        k_phys, v_phys = [], []
        for b in range(bsz):
            t = torch.arange(kv_lens[b])
            blk = block_table[b].to(torch.int64)[t // bs]
            off = t % bs
            blocks_of[b] = (blk, off)
            for cache, acc in ((kc, k_phys), (vc, v_phys)):
                if cache.dim() == 3:  # (blocknum, blocksize, H)
                    x = cache[blk, off].reshape(kv_lens[b], nkv, cache.shape[-1] // nkv).permute(1, 0, 2)
                elif cache.dim() == 5:  # NZ (blocknum, KV_N, D/x, blocksize, x): (n, t, d) at [n, d // x, t, d % x]
                    x = cache[blk, :, :, off].reshape(kv_lens[b], nkv, cache.shape[2] * cache.shape[4]).permute(1, 0, 2)
                else:  # (blocknum, KV_N, blocksize, D)
                    x = cache[blk, :, off].permute(1, 0, 2)
                acc.append(x)
        kv_start = [0] * bsz
    else:
        if in_layout == "TND":
            kv_lens = _cum_to_lens(actual_seq_lengths_kv)
            offs = [sum(kv_lens[:b]) for b in range(bsz)]
            k_phys = [kv_raw(keys)[o:o + s].permute(1, 0, 2) for o, s in zip(offs, kv_lens)]
            v_phys = [kv_raw(values)[o:o + s].permute(1, 0, 2) for o, s in zip(offs, kv_lens)]
            kv_start = [0] * bsz
        else:
            if isinstance(keys, list):
                if len(keys) != bsz:
                    raise ValueError(f"key list has {len(keys)} tensors for B={bsz}")
                k_phys = [_to_bnsd(kv_raw(x), in_layout, nkv)[0] for x in keys]
                v_phys = [_to_bnsd(kv_raw(x), in_layout, nkv)[0] for x in values]
            else:
                k_phys = list(_to_bnsd(kv_raw(keys), in_layout, nkv))
                v_phys = list(_to_bnsd(kv_raw(values), in_layout, nkv))
            s_phys = [x.shape[1] for x in k_phys]
            kv_lens = per_batch(actual_seq_lengths_kv, bsz, s_phys, "actual_seq_lengths_kv")
            if kv_padding_size is not None and actual_seq_lengths_kv is not None:
                pad = max(0, _scalar_int(kv_padding_size))
                kv_start = [s_phys[b] - pad - kv_lens[b] for b in range(bsz)]
                if ifa:  # Q_S = 1: a start (or end) before 0 gives an all-zero batch (seed, kv left padding)
                    kv_lens = [0 if st < 0 else n_ for st, n_ in zip(kv_start, kv_lens)]
                    kv_start = [max(st, 0) for st in kv_start]
            else:
                kv_start = [0] * bsz
            for b in range(bsz):
                if kv_start[b] < 0 or kv_start[b] + kv_lens[b] > s_phys[b]:
                    raise ValueError(f"batch {b}: kv rows [{kv_start[b]}, {kv_start[b] + kv_lens[b]}) outside "
                                     f"[0, {s_phys[b]})")

    # ---- shared prefix
    if (key_shared_prefix is None) != (value_shared_prefix is None):
        raise ValueError("key_shared_prefix and value_shared_prefix must be given together")
    plen = 0
    if key_shared_prefix is not None:
        kp = _to_bnsd(kv_raw(key_shared_prefix), in_layout, nkv)[0]
        vp = _to_bnsd(kv_raw(value_shared_prefix), in_layout, nkv)[0]
        plen = kp.shape[1] if actual_shared_prefix_len is None else _scalar_int(actual_shared_prefix_len)
        kp, vp = kp[:, :plen], vp[:, :plen]

    # ---- output quantization parameters
    q_scale2 = None if quant_scale2 is None else quant_scale2.to(dtype)
    q_off2 = None if quant_offset2 is None else quant_offset2.to(dtype)
    if q_off2 is not None and q_scale2 is None:
        raise ValueError("quant_offset2 needs quant_scale2")
    deq1 = decode_deq_scale(deq_scale1) if full_quant else None
    deq2 = decode_deq_scale(deq_scale2) if full_quant else None
    qs1 = float(quant_scale1.reshape(-1)[0]) if full_quant else None
    if pse_shift is not None:
        pse_shift = pse_shift.to(dtype)

    # ---- per batch
    dv = None
    outs, lses = [], []
    for b in range(bsz):
        sq = q_lens[b]
        lkv = kv_lens[b]
        kb = k_phys[b][:, kv_start[b]:kv_start[b] + lkv]
        vb = v_phys[b][:, kv_start[b]:kv_start[b] + lkv]
        pos = plen + kv_start[b] + torch.arange(lkv)  # per-token parameter index of the key tokens
        blocks = blocks_of[b]
        if not full_quant:
            if kb.dtype == torch.int64:  # int8 / int4 KV with a float query: antiquant
                kb = _dequant(kb, k_spec, b=b, nkv=nkv, pos=pos, blocks=blocks, dtype=dtype)
                vb = _dequant(vb, v_spec, b=b, nkv=nkv, pos=pos, blocks=blocks, dtype=dtype)
            else:
                kb, vb = kb.to(dtype), vb.to(dtype)
        if plen:
            kpb, vpb = kp, vp
            if not full_quant:
                ppos = torch.arange(plen)
                if kp.dtype == torch.int64:
                    kpb = _dequant(kp, k_spec, b=b, nkv=nkv, pos=ppos, blocks=None, dtype=dtype)
                    vpb = _dequant(vp, v_spec, b=b, nkv=nkv, pos=ppos, blocks=None, dtype=dtype)
                else:
                    kpb, vpb = kp.to(dtype), vp.to(dtype)
            kb = torch.cat([kpb.to(kb.dtype), kb], dim=1)
            vb = torch.cat([vpb.to(vb.dtype), vb], dim=1)
        skv = plen + lkv
        dv = vb.shape[-1]
        # physical coordinates of the logical rows i and columns j
        rows = q_start[b] + torch.arange(sq)
        j = torch.arange(skv)
        cols = torch.where(j < plen, j, plen + kv_start[b] + (j - plen))
        if in_layout == "TND":
            rows, cols = torch.arange(sq), j

        keep = _keep(b, sq, skv, rows, cols, ifa=ifa, atten_mask=atten_mask, sparse_mode=sparse_mode,
                     pre=int(pre_tokens), nxt=int(next_tokens),
                     left_pad=(query_padding_size is not None and actual_seq_lengths is not None)
                     or (kv_padding_size is not None and actual_seq_lengths_kv is not None))

        qb = q_rows[b]
        kb_g = kb.repeat_interleave(grp, dim=0)
        vb_g = vb.repeat_interleave(grp, dim=0)
        if full_quant:
            s32 = qb.to(torch.float64) @ kb_g.to(torch.float64).transpose(-1, -2)  # exact integers
            s = (s32 * deq1).to(dtype)  # fixpipe dequant, then the compute dtype
        else:
            s = qb.to(dtype) @ kb_g.transpose(-1, -2)
        s = s * scale_value
        if pse_shift is not None:
            p = pse_shift[b if pse_shift.shape[0] > 1 else 0]  # [N, R, C]
            prow = torch.zeros(sq, dtype=torch.long) if ifa else rows
            s = s + p[:, prow][:, :, cols]
        keep = keep.expand(n, sq, skv)
        valid = keep.any(dim=-1, keepdim=True)
        s_m = torch.where(keep, s, torch.full_like(s, -math.inf))
        m = s_m.amax(dim=-1, keepdim=True) if skv > 0 else torch.full((n, sq, 1), -math.inf, dtype=dtype)
        m_safe = torch.where(valid, m, torch.zeros_like(m))
        e = torch.where(keep, torch.exp(s_m - m_safe), torch.zeros_like(s))
        l = e.sum(dim=-1, keepdim=True)
        l_safe = torch.where(valid, l, torch.ones_like(l))
        if full_quant:
            p_i8 = sat_int8(e * qs1)
            o32 = p_i8.to(torch.float64) @ vb_g.to(torch.float64)  # exact integers
            o = (o32 * deq2).to(dtype) / l_safe
        else:
            o = (e @ vb_g) / l_safe
        o = torch.where(valid, o, torch.zeros_like(o))
        lse = torch.where(valid, m_safe + torch.log(l_safe), torch.full_like(m, math.inf)).to(stat_dtype)
        outs.append(o)
        lses.append(lse)

    # ---- assemble in physical positions (rows outside the actual length: out 0, lse +inf)
    if dv is None:
        dv = (values[0] if isinstance(values, list) else values).shape[-1]
    if in_layout == "TND":
        out = torch.zeros(q_tok, n, dv, dtype=dtype)
        lse_all = torch.full((q_tok, n, 1), math.inf, dtype=stat_dtype)
        for b in range(bsz):
            out[q_off[b]:q_off[b] + q_lens[b]] = outs[b].permute(1, 0, 2)
            lse_all[q_off[b]:q_off[b] + q_lens[b]] = lses[b].permute(1, 0, 2)
    else:
        out = torch.zeros(bsz, n, qs_dim, dv, dtype=dtype)
        lse_all = torch.full((bsz, n, qs_dim, 1), math.inf, dtype=stat_dtype)
        for b in range(bsz):
            out[b, :, q_start[b]:q_start[b] + q_lens[b]] = outs[b]
            lse_all[b, :, q_start[b]:q_start[b] + q_lens[b]] = lses[b]

    out_real = None
    if q_scale2 is not None:
        shape = (1, n, dv) if in_layout == "TND" else (1, n, 1, dv)
        sc2 = q_scale2.reshape(()) if q_scale2.numel() == 1 else q_scale2.reshape(shape)
        of2 = torch.zeros((), dtype=dtype) if q_off2 is None else (
            q_off2.reshape(()) if q_off2.numel() == 1 else q_off2.reshape(shape))
        # rows not computed (fully masked, empty KV, outside the actual length) stay 0 (DECISIONS.md)
        computed = lse_all.isfinite()
        out_real = torch.where(computed, out * sc2 + of2, torch.zeros_like(out))
        out = sat_int8(out_real)

    if in_layout != "TND":
        if out_layout == "BNSD":
            pass
        elif out_layout == "BSND":
            out = out.permute(0, 2, 1, 3)
            out_real = None if out_real is None else out_real.permute(0, 2, 1, 3)
        else:  # BSH
            out = out.permute(0, 2, 1, 3).reshape(bsz, qs_dim, n * dv)
            out_real = None if out_real is None else out_real.permute(0, 2, 1, 3).reshape(bsz, qs_dim, n * dv)
    if not softmax_lse_flag:
        lse_all = torch.zeros(1, dtype=torch.float32)
    return FiaGolden(out.contiguous(), lse_all, None if out_real is None else out_real.contiguous())


def _mask_2d(atten_mask: Tensor, b: int, ifa: bool) -> Tensor:
    """The batch's mask as [R, C] (Q_S > 1) or [1, C] (Q_S = 1); nonzero = masked."""
    m = atten_mask
    if ifa:  # (B, KV_S), (B, 1, KV_S), (B, 1, 1, KV_S)
        m = m.reshape(m.shape[0], -1)
        return m[b if m.shape[0] > 1 else 0].reshape(1, -1) != 0
    if m.dim() == 2:
        return m != 0
    if m.dim() == 3:
        return m[b if m.shape[0] > 1 else 0] != 0
    if m.dim() == 4:
        return m[b if m.shape[0] > 1 else 0, 0] != 0
    raise ValueError(f"atten_mask must be 2-D, 3-D or 4-D, got {tuple(m.shape)}")


def _keep(b, sq, skv, rows, cols, *, ifa, atten_mask, sparse_mode, pre, nxt, left_pad) -> Tensor:
    """keep [1, Sq, Skv] of batch b (cann_semantics.md §1.2, logical i/j; masks read at physical rows/cols)."""
    i = torch.arange(sq).view(sq, 1)
    j = torch.arange(skv).view(1, skv)
    if ifa:
        if atten_mask is None:
            return torch.ones(1, sq, skv, dtype=torch.bool)
        m = _mask_2d(atten_mask, b, True)
        return (~m[:, cols]).expand(sq, skv).unsqueeze(0)

    def explicit():
        m = _mask_2d(atten_mask, b, False)
        return ~m[rows][:, cols]

    delta = skv - sq
    if sparse_mode == 0:
        if atten_mask is None:
            k = torch.ones(sq, skv, dtype=torch.bool)
        elif left_pad:
            k = explicit()
        else:
            k = explicit() & (j - i >= -pre) & (j - i <= nxt)
    elif sparse_mode == 1:
        if atten_mask is None:
            raise ValueError("sparse_mode 1 needs atten_mask")
        k = explicit()
    elif sparse_mode in (2, 3, 4):
        if atten_mask is None:
            raise ValueError(f"sparse_mode {sparse_mode} needs the 2048x2048 compressed atten_mask")
        if sparse_mode == 2:
            k = j <= i
        elif sparse_mode == 3:
            k = j <= i + delta
        else:
            k = ((j - i) - delta >= -pre) & ((j - i) - delta <= nxt)
    else:
        raise ValueError(f"sparse_mode must be in 0..4, got {sparse_mode}")
    return k.expand(sq, skv).unsqueeze(0)
