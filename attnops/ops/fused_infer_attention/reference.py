"""FIA forward on the CPU, one batch at a time, fp32 compute (``cann_semantics.md`` §6.1-6.3, §6.7).

* Short queries (``Sq_b <= DECODE_ROWS``, decode): flash-decoding over the KV read in place (:mod:`.decode`).
* Longer queries (prefill): the FlashAttention CPU reference on the batch's rows and its KV (gathered and
  dequantized only when it is not one in-place run), pse added after the scale (pse_type 0).
* Int8 Q/K/V: the int8 chain, with exact integer GEMMs (in fp64) and P quantized between them.

Rows with nothing to attend to give output 0 and lse +inf; the output is cast with CAST_ROUND or quantized to int8.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch import Tensor

from ..._core import parallel
from ..._core.checks import Described
from ..._core.layouts import Geometry, tokens_view
from ..._core.memory import work_memory
from ..._core.pse import PseSpec
from ..._core.softmax_stats import FLT_LOWEST
from ..._core.varlen import SeqInfo
from ..common import reference as fa_reference
from ..common.problem import FAProblem
from . import decode
from .paged import KVSegment
from .problem import FIAProblem
from .quant import cast_round, quantize_int8

F32, F64 = torch.float32, torch.float64
DECODE_ROWS = 16
INT8_TILE = 4 << 20  # score elements per tile of the int8 chain


def forward(p: FIAProblem) -> tuple[Tensor, Tensor]:
    """``(attention_out, softmax_lse)``: the output in ``p.out_shape`` / ``p.out_dtype`` (rows outside the actual
    query lengths are 0) and the fp32 lse ``[B, N1, Q_S, 1]`` / ``[T, N1, 1]`` (+inf where nothing is attended)."""
    active = active_batches(p)
    half = p.rounding is not None and p.rounding.half_softmax  # fp16 softmax: the prefill route has it
    decoding = [b for b in active if p.int8 is None and not half and p.queries[b].shape[0] <= DECODE_ROWS]
    # a decode call's own tensor operations are small: single-threaded (parallel.serial_ops says why)
    with parallel.serial_ops() if len(decoding) == len(active) else contextlib.nullcontext():
        return _forward(p, active, decoding)


def _forward(p: FIAProblem, active: list[int], decoding: list[int]) -> tuple[Tensor, Tensor]:
    out, lse = new_outputs(p)
    out_tokens = tokens_view(out, p.out_layout, p.n1)
    decoded = decode.forward(p, decoding,
                             convert=None if p.out_quant is not None else functools.partial(convert, p))
    for b in active:
        q = p.queries[b]
        if b in decoded:
            o, l = decoded[b]
        elif p.int8 is not None:
            o, l = _int8_batch(p, b, q)
        else:
            o, l = _prefill_batch(p, b, q)
        store(p, b, o, l, out_tokens, lse)
    return out, lse


def new_outputs(p: FIAProblem) -> tuple[Tensor, Tensor]:
    """The zero output and the +inf lse of the call (rows nothing writes keep them)."""
    with work_memory("query", Described(f"a query for an output of shape {list(p.out_shape)}"), p.device,
                     {"attention_out": (p.out_shape, p.out_dtype), "softmax_lse": (p.lse_shape, F32)}):
        return (torch.zeros(p.out_shape, dtype=p.out_dtype, device=p.device),
                torch.full(p.lse_shape, math.inf, dtype=F32, device=p.device))


def active_batches(p: FIAProblem) -> list[int]:
    """The batches with query rows and keys (the others keep output 0 and lse +inf)."""
    return [b for b, q in enumerate(p.queries) if q.shape[0] > 0 and p.seq.kv_lens[b] > 0]


def store(p: FIAProblem, b: int, o: Tensor, lse_b: Tensor, out_tokens: Tensor, lse: Tensor) -> None:
    """Write batch ``b``'s output ``[Sq, N1, Dv]`` (fp32 or the output dtype; converted) and lse ``[N1, Sq]`` at
    its rows."""
    s, n = p.row_starts[b], o.shape[0]
    if p.out_quant is not None:
        valid = lse_b.isfinite().transpose(0, 1).unsqueeze(-1)
        o = torch.where(valid, p.out_quant.apply(o, p.rounding), 0)
    elif o.dtype != p.out_dtype:
        o = convert(p, o)
    if p.out_layout == "TND":
        out_tokens[s:s + n] = o
        lse[s:s + n, :, 0] = lse_b.transpose(0, 1)
    else:
        out_tokens[b, s:s + n] = o
        lse[b, :, s:s + n, 0] = lse_b


def convert(p: FIAProblem, o: Tensor) -> Tensor:
    """An fp32 output in the output dtype (no output quantization): round half to even where the NPU's output cast
    does, else ``CAST_ROUND``."""
    if p.rounding is not None and p.rounding.even_output:
        return o.to(p.out_dtype)
    return cast_round(o, p.out_dtype)


def _run(x: Tensor, quant, b: int, seg: KVSegment, dtype: torch.dtype, rounding=None) -> Tensor:
    """A key or value run ``[R, N2, L, D]`` in ``dtype`` (dequantized in fp32 first when ``quant`` is given, with
    the NPU's roundings under ``rounding``)."""
    return x.to(dtype) if quant is None else quant.apply(x, b, seg.pos, seg.block, rounding).to(dtype)


def _tokens(x: Tensor) -> Tensor:
    """``[R, N2, L, D]`` -> ``[R*L, N2, D]``."""
    return x.transpose(1, 2).flatten(0, 1)


def _batch_kv(p: FIAProblem, b: int, dequantize: bool = True, dtype: torch.dtype = F32) -> tuple[Tensor, Tensor]:
    """Batch ``b``'s effective K ``[Skv, N2, Dk]`` and V ``[Skv, N2, Dv]`` in ``dtype`` (views when one in-place run
    of that dtype)."""
    ks, vs = [], []
    for seg in p.kv[b]:
        if dequantize:
            ks.append(_tokens(_run(seg.key, p.key_quant, b, seg, dtype, p.rounding)))
            vs.append(_tokens(_run(seg.value, p.value_quant, b, seg, dtype, p.rounding)))
        else:
            ks.append(_tokens(seg.key))
            vs.append(_tokens(seg.value))
    return (ks[0], vs[0]) if len(ks) == 1 else (torch.cat(ks), torch.cat(vs))


def _shift_and_mask_(p: FIAProblem, b: int, s: Tensor, r0: int, r1: int, heads: slice) -> Tensor:
    """Add the pse and set masked scores to -inf, in place, on a score tile ``[Nh, r1-r0, Skv]``."""
    skv = s.shape[-1]
    if p.pse is not None:
        s.add_(p.pse.block(b, r0, r1, 0, skv, heads, s.dtype))
    return p.mask.fill_masked_(s, b, r0, r1, 0, skv, heads)


def _softmax_(p: FIAProblem, b: int, heads: slice, s: Tensor, r0: int, r1: int) -> tuple[Tensor, Tensor]:
    """In place ``s -> exp(s - rowmax)`` on the masked scores ``[heads, r1-r0, Skv]`` of batch ``b``; returns the row
    sums (1 for rows that see no key) and the lse (+inf for them). A NaN max (a NaN score) keeps its row NaN, and so
    does a row that sees keys whose scores are all -inf (the formula's ``0 / 0``)."""
    m = s.amax(-1, keepdim=True)
    valid = m != -math.inf
    s.sub_(torch.where(valid, m, 0.0)).exp_()
    total = s.sum(-1, keepdim=True)
    decode.nan_sums_of_unkept_rows_(p, b, heads, r0, r1, 0, s.shape[-1], m.squeeze(-1), total.squeeze(-1))
    valid |= total.isnan()
    lse = torch.where(valid, m + total.log(), math.inf)
    return torch.where(valid, total, 1.0), lse.squeeze(-1)


def prefill_problem(p: FIAProblem, b: int, dtype: torch.dtype) -> tuple[FAProblem, Tensor, Tensor, Tensor]:
    """Batch ``b`` as a one-batch FlashAttention problem (BSND, pse after the scale) with its query ``[1, Sq, N1, D]``
    and effective K/V ``[1, Skv, N2, D]`` in ``dtype`` (dequantized, gathered from pages, prefix first)."""
    q = p.queries[b]
    sq, skv = q.shape[0], p.seq.kv_lens[b]
    k, v = _batch_kv(p, b, dtype=dtype)
    pse = None
    if p.pse is not None:
        t = p.pse.tensor
        pse = PseSpec(0, "full", t if t.shape[0] == 1 else t[b:b + 1])
    fa = FAProblem(Geometry("BSND", p.n1, p.n2, p.d, p.dv, 1, sq, skv), SeqInfo.dense(1, sq, skv), p.mask.batch(b),
                   pse, None, p.scale, "", sq, skv, rounding=p.rounding)
    return fa, q.to(dtype)[None], k[None], v[None]


def stats_lse(smax: Tensor, ssum: Tensor) -> Tensor:
    """The lse ``[N1, Sq]`` of one-batch FlashAttention statistics (+inf where the row sees no key; NaN where the
    statistics are)."""
    m, total = smax[0, :, :, 0].float(), ssum[0, :, :, 0].float()
    return torch.where(m == FLT_LOWEST, math.inf, m + total.log())


def _prefill_batch(p: FIAProblem, b: int, q: Tensor) -> tuple[Tensor, Tensor]:
    """Many query rows: the FlashAttention CPU reference on one batch."""
    fa, q, k, v = prefill_problem(p, b, F32)
    out, smax, ssum = fa_reference.forward(fa, q, k, v)
    return out[0], stats_lse(smax, ssum)


def _int8_batch(p: FIAProblem, b: int, q: Tensor) -> tuple[Tensor, Tensor]:
    """The int8 chain: ``S = (Q K^T) deq1`` -> scale, pse, mask -> ``P~ = exp(S - max)`` ->
    ``O = (sat_int8(P~ qs1) V) deq2 / sum(P~)``. Integer GEMMs are exact in fp64."""
    sq, skv, g = q.shape[0], p.seq.kv_lens[b], p.group
    deq1, qs1, deq2 = p.int8.deq_scale1, p.int8.quant_scale1, p.int8.deq_scale2
    k, v = _batch_kv(p, b, dequantize=False)
    qh, kh, vh = (x.transpose(0, 1).to(F64) for x in (q, k, v))  # [N, S, D]
    o = torch.empty(p.n1, sq, p.dv, dtype=F32, device=q.device)
    lse = torch.empty(p.n1, sq, dtype=F32, device=q.device)
    rows = max(1, INT8_TILE // (g * skv))
    for n2 in range(p.n2):
        heads = slice(n2 * g, (n2 + 1) * g)
        for r0 in range(0, sq, rows):
            r1 = min(sq, r0 + rows)
            s = torch.matmul(qh[heads, r0:r1], kh[n2].transpose(0, 1)).to(F32).mul_(deq1).mul_(p.scale)
            total, lse[heads, r0:r1] = _softmax_(p, b, heads, _shift_and_mask_(p, b, s, r0, r1, heads), r0, r1)
            p_i8 = quantize_int8(s.mul_(qs1)).to(F64)
            o[heads, r0:r1] = torch.matmul(p_i8, vh[n2]).mul_(deq2).to(F32).div_(total)
    return o.transpose(0, 1), lse
