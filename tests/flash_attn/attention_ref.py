"""An independent dense reference of flash-attn's documented semantics (written from its docstrings, not its code):
``[B, S, H, D]`` tensors, GQA by repeating KV heads, scores ``softmax_scale * q k^T``, then ``softcap * tanh(S /
softcap)``, then the ALiBi bias ``-slope * |i + Sk - Sq - j|``, then the bottom-right aligned causal / window
mask, softmax (rows with no key: 0), dropout by a given keep mask scaled by ``1 / (1 - dropout_p)``."""
from __future__ import annotations

import torch
from torch import Tensor


def keep_matrix(sq: int, sk: int, causal: bool, window_size, device=None) -> Tensor:
    """Bool ``[Sq, Sk]``: key j kept by query i iff ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``."""
    left, right = window_size
    right = 0 if causal else right
    i, j = torch.arange(sq, device=device)[:, None], torch.arange(sk, device=device)[None]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= j >= i + sk - sq - left
    if right >= 0:
        keep &= j <= i + sk - sq + right
    return keep


def attention_ref(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  alibi_slopes=None, dropout_p=0.0, keep=None, dtype=torch.float64):
    """``(out [B, Sq, H, Dv], lse [B, H, Sq])`` computed in ``dtype`` (fp64: the golden; the inputs' dtype: the
    plain low-precision baseline of the tolerance rule). ``keep``: bool ``[B, H, Sq, Sk]`` dropout mask."""
    out_dtype = q.dtype
    q, k, v = (x.to(dtype) for x in (q, k, v))
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    k, v = (x.repeat_interleave(h // hk, dim=2) for x in (k, v))
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    i, j = torch.arange(sq, device=q.device)[:, None], torch.arange(sk, device=q.device)[None]
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype).reshape(-1 if alibi_slopes.dim() == 2 else 1, h, 1, 1)
        s = s - slopes * (i + sk - sq - j).abs().to(dtype)
    s = s.masked_fill(~keep_matrix(sq, sk, causal, window_size, q.device), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out.to(out_dtype), lse.masked_fill(lse == float("-inf"), float("inf"))


def attention_ref_varlen(q, k, v, cu_q: list[int], cu_k: list[int], **options):
    """:func:`attention_ref` per sequence of ``[T, H, D]`` tensors; ``(out [T_q, H, Dv], lse [H, T_q])``
    (``keep``, when given, ``[B, H, max Sq, max Sk]``)."""
    keep = options.pop("keep", None)
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qb, kb, vb = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        kb_keep = None if keep is None else keep[b:b + 1, :, :qb.shape[0], :kb.shape[0]]
        out, lse = attention_ref(qb[None], kb[None], vb[None], keep=kb_keep, **options)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)
