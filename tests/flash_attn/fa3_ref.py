"""An independent dense reference of FlashAttention-3's documented additions (written from its docstrings and its
test suite's definitions, not attnops' code): ``qv`` adds ``qv . v`` to the scores (default scale
``(D + Dv) ** -0.5``); ``attention_chunk = C`` keeps key ``j`` for row ``i`` only inside the chunk of
``p = i + Sk - Sq``: ``p - p % C <= j < p - p % C + C``; ``seqused_q/k`` use the first tokens of each packed
segment (masks aligned to the used lengths; other rows give 0 and lse ``+inf``)."""
from __future__ import annotations

import torch
from torch import Tensor

from tests.flash_attn.attention_ref import keep_matrix


def fa3_keep(sq: int, sk: int, causal: bool, window_size, attention_chunk: int) -> Tensor:
    """Bool ``[Sq, Sk]``: flash-attn's bottom-right causal/window band, and the chunk rule when ``attention_chunk``."""
    keep = keep_matrix(sq, sk, causal, window_size)
    if attention_chunk > 0:
        p = torch.arange(sq)[:, None] + sk - sq
        start = p - p % attention_chunk  # Python's floor modulo: rows with p < 0 see no key
        j = torch.arange(sk)[None]
        keep &= (j >= start) & (j < start + attention_chunk)
    return keep


def fa3_ref(q, k, v, *, qv=None, softmax_scale=None, causal=False, window_size=(-1, -1), attention_chunk=0,
            softcap=0.0, dtype=torch.float64):
    """``(out [B, Sq, H, Dv], lse [B, H, Sq])`` in ``dtype`` of ``[B, S, H, D]`` inputs (GQA by repeating heads)."""
    out_dtype = q.dtype
    q, k, v = (x.to(dtype) for x in (q, k, v))
    h, d, dv = q.shape[2], q.shape[3], v.shape[3]
    k, v = (x.repeat_interleave(h // x.shape[2], dim=2) for x in (k, v))
    scale = (d + (dv if qv is not None else 0)) ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k)
    if qv is not None:
        s = s + torch.einsum("bqhd,bkhd->bhqk", qv.to(dtype), v)
    s = s * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~fa3_keep(q.shape[1], k.shape[1], causal, window_size, attention_chunk), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1).nan_to_num(0.0), v)
    return out.to(out_dtype), lse.masked_fill(lse == float("-inf"), float("inf"))


def fa3_ref_varlen(q, k, v, cu_q: list[int], cu_k: list[int], used_q=None, used_k=None, qv=None, **options):
    """:func:`fa3_ref` per packed sequence, on its first ``used_q[b]`` rows and ``used_k[b]`` keys (default all);
    ``(out [T_q, H, Dv], lse [H, T_q])``, unused rows 0 with lse ``+inf``."""
    dtype = options.get("dtype", torch.float64)
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        n_q, n_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        uq = n_q if used_q is None else used_q[b]
        uk = n_k if used_k is None else used_k[b]
        rows, keys = slice(cu_q[b], cu_q[b] + uq), slice(cu_k[b], cu_k[b] + uk)
        out, lse = fa3_ref(q[rows][None], k[keys][None], v[keys][None],
                           qv=None if qv is None else qv[rows][None], **options)
        pad = n_q - uq
        outs += [out[0], q.new_zeros(pad, q.shape[1], v.shape[2]).to(out.dtype)]
        lses += [lse[0], torch.full((q.shape[1], pad), float("inf"), dtype=dtype)]
    return torch.cat(outs), torch.cat(lses, dim=-1)
