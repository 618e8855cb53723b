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
from dataclasses import dataclass

import torch
from torch import Tensor

from .golden import _to_bnsd
from .golden_fia_quant import (antiquant_specs, decode_deq_scale, dequant, encode_deq_scale,
                               integer_values, is_quantized, pack_int4, sat_int8, unpack_int4)

INT_MAX = 2147483647

__all__ = ["fia_forward", "fia_forward_detail", "FiaGolden", "pack_int4", "unpack_int4", "encode_deq_scale",
           "decode_deq_scale", "sat_int8", "per_batch"]


# ----------------------------------------------------------------------------------------------- small helpers
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


# ------------------------------------------------------------------------------------------------ layouts
def _layouts(input_layout: str) -> tuple[str, str]:
    if input_layout == "BNSD_BSND":
        return "BNSD", "BSND"
    if input_layout in ("BSH", "BSND", "BNSD", "TND"):
        return input_layout, input_layout
    raise ValueError(f"input_layout must be BSH, BSND, BNSD, BNSD_BSND or TND, got {input_layout!r}")


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
    full_quant = query.dtype == torch.int8
    if full_quant and (deq_scale1 is None or quant_scale1 is None or deq_scale2 is None):
        raise ValueError("int8 query needs deq_scale1, quant_scale1 and deq_scale2")
    keys = list(key) if isinstance(key, (list, tuple)) else key
    values = list(value) if isinstance(value, (list, tuple)) else value
    if isinstance(keys, list) and len(keys) == 1:  # a TensorList of one tensor is the contiguous case
        keys, values = keys[0], values[0]
    k_spec, v_spec = antiquant_specs(antiquant_scale, antiquant_offset, antiquant_mode, key_antiquant_scale,
                                      key_antiquant_offset, value_antiquant_scale, value_antiquant_offset,
                                      key_antiquant_mode, value_antiquant_mode)
    q = _query_rows(query, in_layout, n, actual_seq_lengths, query_padding_size)
    if block_table is not None:
        kv = _paged_kv_rows(keys, values, block_table, block_size, actual_seq_lengths_kv, q.batch, nkv)
    else:
        kv = _dense_kv_rows(keys, values, in_layout, nkv, q, actual_seq_lengths_kv, kv_padding_size)
    prefix = _shared_prefix(key_shared_prefix, value_shared_prefix, actual_shared_prefix_len, in_layout, nkv)

    q_scale2 = None if quant_scale2 is None else quant_scale2.to(dtype)
    q_off2 = None if quant_offset2 is None else quant_offset2.to(dtype)
    if q_off2 is not None and q_scale2 is None:
        raise ValueError("quant_offset2 needs quant_scale2")
    int8 = _Int8Chain(decode_deq_scale(deq_scale1), float(quant_scale1.reshape(-1)[0]),
                      decode_deq_scale(deq_scale2)) if full_quant else None
    if pse_shift is not None:
        pse_shift = pse_shift.to(dtype)
    left_pad = (query_padding_size is not None and actual_seq_lengths is not None) or \
        (kv_padding_size is not None and actual_seq_lengths_kv is not None)

    dv = None
    outs, lses = [], []
    for b in range(q.batch):
        kb, vb = _batch_kv(b, kv, prefix, k_spec, v_spec, nkv=nkv, full_quant=full_quant, dtype=dtype)
        sq, skv, plen = q.lens[b], kb.shape[1], prefix[2]
        dv = vb.shape[-1]
        # physical coordinates of the logical rows i and columns j
        rows = q.start[b] + torch.arange(sq)
        j = torch.arange(skv)
        cols = torch.where(j < plen, j, plen + kv.start[b] + (j - plen))
        if in_layout == "TND":
            rows, cols = torch.arange(sq), j
        keep = _keep(b, sq, skv, rows, cols, ifa=q.ifa, atten_mask=atten_mask, sparse_mode=sparse_mode,
                     pre=int(pre_tokens), nxt=int(next_tokens), left_pad=left_pad)
        s = _scores(q.rows[b], kb.repeat_interleave(n // nkv, dim=0), int8=int8, scale_value=scale_value,
                    pse_shift=pse_shift, b=b, ifa=q.ifa, rows=rows, cols=cols, dtype=dtype)
        o, lse = _softmax_out(s, keep.expand(n, sq, skv), vb.repeat_interleave(n // nkv, dim=0), int8=int8,
                              dtype=dtype, stat_dtype=stat_dtype)
        outs.append(o)
        lses.append(lse)
    if dv is None:
        dv = (values[0] if isinstance(values, list) else values).shape[-1]
    out, lse_all = _assemble(outs, lses, q, in_layout, n, dv, dtype, stat_dtype)
    out, out_real = _quantize_output(out, lse_all, q_scale2, q_off2, in_layout, n, dv, dtype)
    if in_layout != "TND":
        out = _to_out_layout(out, out_layout, q, n, dv)
        out_real = None if out_real is None else _to_out_layout(out_real, out_layout, q, n, dv)
    if not softmax_lse_flag:
        lse_all = torch.zeros(1, dtype=torch.float32)
    return FiaGolden(out.contiguous(), lse_all, None if out_real is None else out_real.contiguous())


@dataclass
class _Queries:
    """Per batch the valid query rows ``[N, Sq_b, D]``, their lengths and first physical row (``start``; TND: 0 and
    the token ``offsets``); ``tokens`` (TND: T) and ``s_dim`` (other layouts: Q_S) size the output."""

    rows: list
    lens: list[int]
    start: list[int]
    offsets: list[int] | None
    tokens: int | None
    s_dim: int | None
    ifa: bool

    @property
    def batch(self) -> int:
        return len(self.lens)


def _query_rows(query, in_layout, n, actual_seq_lengths, query_padding_size) -> _Queries:
    """The query per batch plus the physical offset of its first valid row."""
    if in_layout == "TND":
        q_lens = _cum_to_lens(actual_seq_lengths)
        q_off = [sum(q_lens[:b]) for b in range(len(q_lens))]
        q_rows = [query[o:o + s].permute(1, 0, 2) for o, s in zip(q_off, q_lens)]
        return _Queries(q_rows, q_lens, [0] * len(q_lens), q_off, query.shape[0], None, False)
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
    return _Queries(q_rows, q_lens, q_start, None, None, qs_dim, ifa)


@dataclass
class _KVRows:
    """Per batch the physical K and V ``[N2, S, D]`` (integer values kept as int64 until dequantization), the
    valid length and first row, and for paged KV the ``(block ids, offsets)`` of each token (else None)."""

    keys: list
    values: list
    lens: list[int]
    start: list[int]
    blocks: list


def _kv_raw(x: Tensor) -> Tensor:
    return integer_values(x) if is_quantized(x) else x


def _paged_kv_rows(keys, values, block_table, block_size, actual_seq_lengths_kv, bsz, nkv) -> _KVRows:
    """The tokens of each batch gathered from the pages of ``block_table``, in the three cache layouts."""
    bs = int(block_size) if block_size else keys.shape[1 if keys.dim() == 3 else keys.dim() - 2]
    kv_lens = per_batch(actual_seq_lengths_kv, bsz, 0, "actual_seq_lengths_kv")
    if actual_seq_lengths_kv is None:
        raise ValueError("paged KV needs actual_seq_lengths_kv")
    kc, vc = _kv_raw(keys), _kv_raw(values)
    k_phys, v_phys, blocks_of = [], [], []
    for b in range(bsz):
        t = torch.arange(kv_lens[b])
        blk = block_table[b].to(torch.int64)[t // bs]
        off = t % bs
        blocks_of.append((blk, off))
        for cache, acc in ((kc, k_phys), (vc, v_phys)):
            if cache.dim() == 3:  # (blocknum, blocksize, H)
                x = cache[blk, off].reshape(kv_lens[b], nkv, cache.shape[-1] // nkv).permute(1, 0, 2)
            elif cache.dim() == 5:  # NZ (blocknum, KV_N, D/x, blocksize, x): (n, t, d) at [n, d // x, t, d % x]
                x = cache[blk, :, :, off].reshape(kv_lens[b], nkv, cache.shape[2] * cache.shape[4]).permute(1, 0, 2)
            else:  # (blocknum, KV_N, blocksize, D)
                x = cache[blk, :, off].permute(1, 0, 2)
            acc.append(x)
    return _KVRows(k_phys, v_phys, kv_lens, [0] * bsz, blocks_of)


def _dense_kv_rows(keys, values, in_layout, nkv, q: _Queries, actual_seq_lengths_kv, kv_padding_size) -> _KVRows:
    """The K/V of each batch from a dense tensor, a list of per-batch tensors or TND tokens, with left padding."""
    bsz = q.batch
    if in_layout == "TND":
        kv_lens = _cum_to_lens(actual_seq_lengths_kv)
        offs = [sum(kv_lens[:b]) for b in range(bsz)]
        k_phys = [_kv_raw(keys)[o:o + s].permute(1, 0, 2) for o, s in zip(offs, kv_lens)]
        v_phys = [_kv_raw(values)[o:o + s].permute(1, 0, 2) for o, s in zip(offs, kv_lens)]
        return _KVRows(k_phys, v_phys, kv_lens, [0] * bsz, [None] * bsz)
    if isinstance(keys, list):
        if len(keys) != bsz:
            raise ValueError(f"key list has {len(keys)} tensors for B={bsz}")
        k_phys = [_to_bnsd(_kv_raw(x), in_layout, nkv)[0] for x in keys]
        v_phys = [_to_bnsd(_kv_raw(x), in_layout, nkv)[0] for x in values]
    else:
        k_phys = list(_to_bnsd(_kv_raw(keys), in_layout, nkv))
        v_phys = list(_to_bnsd(_kv_raw(values), in_layout, nkv))
    s_phys = [x.shape[1] for x in k_phys]
    kv_lens = per_batch(actual_seq_lengths_kv, bsz, s_phys, "actual_seq_lengths_kv")
    if kv_padding_size is not None and actual_seq_lengths_kv is not None:
        pad = max(0, _scalar_int(kv_padding_size))
        kv_start = [s_phys[b] - pad - kv_lens[b] for b in range(bsz)]
        if q.ifa:  # Q_S = 1: a start (or end) before 0 gives an all-zero batch (seed, kv left padding)
            kv_lens = [0 if st < 0 else n_ for st, n_ in zip(kv_start, kv_lens)]
            kv_start = [max(st, 0) for st in kv_start]
    else:
        kv_start = [0] * bsz
    for b in range(bsz):
        if kv_start[b] < 0 or kv_start[b] + kv_lens[b] > s_phys[b]:
            raise ValueError(f"batch {b}: kv rows [{kv_start[b]}, {kv_start[b] + kv_lens[b]}) outside "
                             f"[0, {s_phys[b]})")
    return _KVRows(k_phys, v_phys, kv_lens, kv_start, [None] * bsz)


def _shared_prefix(key_shared_prefix, value_shared_prefix, actual_shared_prefix_len, in_layout, nkv):
    """``(K prefix, V prefix, L)``: the first L rows of the shared prefix (``(None, None, 0)`` without one)."""
    if (key_shared_prefix is None) != (value_shared_prefix is None):
        raise ValueError("key_shared_prefix and value_shared_prefix must be given together")
    if key_shared_prefix is None:
        return None, None, 0
    kp = _to_bnsd(_kv_raw(key_shared_prefix), in_layout, nkv)[0]
    vp = _to_bnsd(_kv_raw(value_shared_prefix), in_layout, nkv)[0]
    plen = kp.shape[1] if actual_shared_prefix_len is None else _scalar_int(actual_shared_prefix_len)
    return kp[:, :plen], vp[:, :plen], plen


def _batch_kv(b, kv: _KVRows, prefix, k_spec, v_spec, *, nkv, full_quant, dtype) -> tuple[Tensor, Tensor]:
    """Batch ``b``'s K and V ``[N2, L + Skv_b, D]``: the shared prefix, then its keys (dequantized or cast to
    ``dtype`` unless the query is int8)."""
    kp, vp, plen = prefix
    lkv = kv.lens[b]
    kb = kv.keys[b][:, kv.start[b]:kv.start[b] + lkv]
    vb = kv.values[b][:, kv.start[b]:kv.start[b] + lkv]
    pos = plen + kv.start[b] + torch.arange(lkv)  # per-token parameter index of the key tokens
    if not full_quant:
        if kb.dtype == torch.int64:  # int8 / int4 KV with a float query: antiquant
            kb = dequant(kb, k_spec, b=b, nkv=nkv, pos=pos, blocks=kv.blocks[b], dtype=dtype)
            vb = dequant(vb, v_spec, b=b, nkv=nkv, pos=pos, blocks=kv.blocks[b], dtype=dtype)
        else:
            kb, vb = kb.to(dtype), vb.to(dtype)
    if plen:
        kpb, vpb = kp, vp
        if not full_quant:
            ppos = torch.arange(plen)
            if kp.dtype == torch.int64:
                kpb = dequant(kp, k_spec, b=b, nkv=nkv, pos=ppos, blocks=None, dtype=dtype)
                vpb = dequant(vp, v_spec, b=b, nkv=nkv, pos=ppos, blocks=None, dtype=dtype)
            else:
                kpb, vpb = kp.to(dtype), vp.to(dtype)
        kb = torch.cat([kpb.to(kb.dtype), kb], dim=1)
        vb = torch.cat([vpb.to(vb.dtype), vb], dim=1)
    return kb, vb


@dataclass
class _Int8Chain:
    """The int8 Q/K/V parameters (§6.7): ``deq_scale1``, ``quant_scale1`` and ``deq_scale2`` as floats."""

    deq1: float
    qs1: float
    deq2: float


def _scores(qb, kb_g, *, int8: _Int8Chain | None, scale_value, pse_shift, b, ifa, rows, cols, dtype) -> Tensor:
    """``S = scale * Q K^T + pse`` of one batch (int8: exact integer products, then ``deq_scale1``)."""
    if int8 is not None:
        s32 = qb.to(torch.float64) @ kb_g.to(torch.float64).transpose(-1, -2)  # exact integers
        s = (s32 * int8.deq1).to(dtype)  # fixpipe dequant, then the compute dtype
    else:
        s = qb.to(dtype) @ kb_g.transpose(-1, -2)
    s = s * scale_value
    if pse_shift is not None:
        p = pse_shift[b if pse_shift.shape[0] > 1 else 0]  # [N, R, C]
        prow = torch.zeros(s.shape[1], dtype=torch.long) if ifa else rows
        s = s + p[:, prow][:, :, cols]
    return s


def _softmax_out(s, keep, vb_g, *, int8: _Int8Chain | None, dtype, stat_dtype) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of one batch's masked scores; rows with nothing to attend to give 0 and ``+inf``."""
    n, sq, skv = keep.shape
    valid = keep.any(dim=-1, keepdim=True)
    s_m = torch.where(keep, s, torch.full_like(s, -math.inf))
    m = s_m.amax(dim=-1, keepdim=True) if skv > 0 else torch.full((n, sq, 1), -math.inf, dtype=dtype)
    m_safe = torch.where(valid, m, torch.zeros_like(m))
    e = torch.where(keep, torch.exp(s_m - m_safe), torch.zeros_like(s))
    l = e.sum(dim=-1, keepdim=True)
    l_safe = torch.where(valid, l, torch.ones_like(l))
    if int8 is not None:
        p_i8 = sat_int8(e * int8.qs1)
        o32 = p_i8.to(torch.float64) @ vb_g.to(torch.float64)  # exact integers
        o = (o32 * int8.deq2).to(dtype) / l_safe
    else:
        o = (e @ vb_g) / l_safe
    o = torch.where(valid, o, torch.zeros_like(o))
    lse = torch.where(valid, m_safe + torch.log(l_safe), torch.full_like(m, math.inf)).to(stat_dtype)
    return o, lse


def _assemble(outs, lses, q: _Queries, in_layout, n, dv, dtype, stat_dtype) -> tuple[Tensor, Tensor]:
    """The batches in physical positions (TND ``[T, N, Dv]``, else BNSD); rows outside the actual length: out 0,
    lse +inf."""
    if in_layout == "TND":
        out = torch.zeros(q.tokens, n, dv, dtype=dtype)
        lse_all = torch.full((q.tokens, n, 1), math.inf, dtype=stat_dtype)
        for b in range(q.batch):
            out[q.offsets[b]:q.offsets[b] + q.lens[b]] = outs[b].permute(1, 0, 2)
            lse_all[q.offsets[b]:q.offsets[b] + q.lens[b]] = lses[b].permute(1, 0, 2)
        return out, lse_all
    out = torch.zeros(q.batch, n, q.s_dim, dv, dtype=dtype)
    lse_all = torch.full((q.batch, n, q.s_dim, 1), math.inf, dtype=stat_dtype)
    for b in range(q.batch):
        out[b, :, q.start[b]:q.start[b] + q.lens[b]] = outs[b]
        lse_all[b, :, q.start[b]:q.start[b] + q.lens[b]] = lses[b]
    return out, lse_all


def _quantize_output(out, lse_all, q_scale2, q_off2, in_layout, n, dv, dtype) -> tuple[Tensor, Tensor | None]:
    """``(out, out_real)``: with ``quant_scale2``, the int8 output and the unrounded ``out * scale + offset``."""
    if q_scale2 is None:
        return out, None
    shape = (1, n, dv) if in_layout == "TND" else (1, n, 1, dv)
    sc2 = q_scale2.reshape(()) if q_scale2.numel() == 1 else q_scale2.reshape(shape)
    of2 = torch.zeros((), dtype=dtype) if q_off2 is None else (
        q_off2.reshape(()) if q_off2.numel() == 1 else q_off2.reshape(shape))
    # rows not computed (fully masked, empty KV, outside the actual length) stay 0 (DECISIONS.md)
    computed = lse_all.isfinite()
    out_real = torch.where(computed, out * sc2 + of2, torch.zeros_like(out))
    return sat_int8(out_real), out_real


def _to_out_layout(out: Tensor, out_layout: str, q: _Queries, n, dv) -> Tensor:
    """A BNSD output in ``out_layout`` (BNSD, BSND or BSH)."""
    if out_layout == "BNSD":
        return out
    if out_layout == "BSND":
        return out.permute(0, 2, 1, 3)
    return out.permute(0, 2, 1, 3).reshape(q.batch, q.s_dim, n * dv)


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
