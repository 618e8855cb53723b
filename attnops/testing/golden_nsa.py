"""Dense golden of the NSA operators (``cann_semantics.md`` §7, ``DECISIONS.md`` NSA), written straight from the spec.

Independent of :mod:`attnops.ops` and :mod:`attnops._core`: plain loops and gathers, computed in the ``dtype``
argument (float64 for the golden; float16/bfloat16/float32 for the "plain PyTorch in low precision" baseline of
the tolerance rule, with no upcasting). Gradients come from ``torch.autograd`` through the same forward.

Softmax statistics are returned in ``dtype`` for float32/float64 and in a float32 container for float16/bfloat16
(the values are computed in the low dtype), because FLT_MAX / FLT_LOWEST of fully-masked rows do not fit 16 bits.

Functions:

* :func:`nsa_compress` / :func:`nsa_compress_backward` (§7.1-7.2);
* :func:`nsa_selected_attention` / :func:`nsa_selected_attention_backward` (§7.4-7.5);
* :func:`nsa_compress_attention` / :func:`nsa_compress_attention_backward` (§7.3), with the importance scores
  available through ``return_scores=True``;
* :func:`nsa_select_attention_infer`, :func:`nsa_compress_attention_infer` and :func:`nsa_compress_infer_cache`
  (torch_npu_api.md §8.4, op-plugin's goldens for the three ops): decoding over a paged cache.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .golden import seq_lengths

FLT_MAX = 3.4028234663852886e38
FLT_LOWEST = -FLT_MAX
LANES = 8

__all__ = ["FLT_MAX", "FLT_LOWEST", "cum_to_lengths", "nsa_compress", "nsa_compress_backward",
           "nsa_selected_attention", "nsa_selected_attention_backward", "nsa_compress_attention",
           "nsa_compress_attention_backward", "importance_score_literal"]


def _ints(x) -> list[int]:
    if x is None:
        return None
    if isinstance(x, Tensor):
        return [int(v) for v in x.tolist()]
    return [int(v) for v in x]


cum_to_lengths = seq_lengths  # per-batch lengths of a CANN cumulative list (shared with the FA golden)


def _starts(lens: list[int]) -> list[int]:
    out, acc = [], 0
    for n in lens:
        out.append(acc)
        acc += n
    return out


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# ------------------------------------------------------------------------------------------------ compress
def nsa_compress(input: Tensor, weight: Tensor, block: int, stride: int, act_seq_len, *,
                 dtype: torch.dtype = torch.float64) -> Tensor:
    """``[sum_b blocks_b, N, D]``: ``out[c, n, :] = sum_{w<l} input[start_b + k*d + w, n, :] * weight[w, n]``.

    ``act_seq_len`` is cumulative (a leading 0 is an empty batch); ``None`` means one batch of all T tokens.
    Sequences shorter than ``block`` give no rows; tails that do not fill a block are dropped.
    """
    x = input.to(dtype)
    w = weight.to(dtype)
    lens = [x.shape[0]] if act_seq_len is None else cum_to_lengths(act_seq_len)
    rows = []
    for start, n in zip(_starts(lens), lens):
        if n < block:
            continue
        for k in range((n - block) // stride + 1):
            s = start + k * stride
            acc = x[s] * w[0].unsqueeze(-1)
            for j in range(1, block):
                acc = acc + x[s + j] * w[j].unsqueeze(-1)
            rows.append(acc)
    if not rows:
        return x.new_zeros((0, x.shape[1], x.shape[2]))
    return torch.stack(rows)


def nsa_compress_backward(output_grad: Tensor, input: Tensor, weight: Tensor, block: int, stride: int, act_seq_len,
                          *, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """``(input_grad, weight_grad)`` by autograd through :func:`nsa_compress` in ``dtype``."""
    x = input.detach().to(dtype).requires_grad_()
    w = weight.detach().to(dtype).requires_grad_()
    out = nsa_compress(x, w, block, stride, act_seq_len, dtype=dtype)
    if out.numel() == 0:
        return torch.zeros_like(x), torch.zeros_like(w)
    gx, gw = torch.autograd.grad(out, (x, w), output_grad.to(dtype), allow_unused=True)
    return (torch.zeros_like(x) if gx is None else gx), (torch.zeros_like(w) if gw is None else gw)


# ------------------------------------------------------------------------------------------------ selected
def nsa_selected_attention(q: Tensor, k: Tensor, v: Tensor, topk: Tensor, scale: float, block_size: int,
                           actual_seq_qlen, actual_seq_kvlen, causal: bool, *, dtype: torch.dtype = torch.float64,
                           return_lse: bool = False) -> tuple[Tensor, ...]:
    """``(out [T1, N1, Dv], softmax_max [T1, N1, 8], softmax_sum [T1, N1, 8])`` (statistics true TND order), and
    with ``return_lse`` the differentiable log-sum-exp ``[T1, N1]`` of the selected scores (0 on fully-masked rows).

    Token ``t`` (batch ``b``, local index ``i``), query head ``h`` (KV head ``h // G``) attends to the
    concatenation of the blocks ``topk[t, h // G, :]`` (block indices local to batch ``b``, duplicates kept; an
    index outside the batch's whole blocks, unvalidated, selects nothing).
    Causal: local KV position ``p`` is visible iff ``p <= i``. Fully-masked rows: out 0, max FLT_LOWEST,
    sum FLT_MAX. Tokens after the last batch: out 0, invalid statistics.

    Computed per batch as: dense scores ``S = scale * q k^T``; per token and head the gathered list of selected
    scores ``S[pos]`` (``pos`` = the selected blocks' KV positions in top-k order, duplicates kept); softmax over
    that list, times the gathered values ``V[pos]``. This equals ``softmax(q K_sel^T) V_sel``; a key no token
    selects never enters an output (a NaN there stays out).
    """
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    t1, n1, _ = q.shape
    n2 = k.shape[1]
    g = n1 // n2
    dv = v.shape[2]
    sdt = _stat_dtype(dtype)
    q_lens, kv_lens = cum_to_lengths(actual_seq_qlen), cum_to_lengths(actual_seq_kvlen)
    if len(q_lens) != len(kv_lens):
        raise ValueError("actual_seq_qlen and actual_seq_kvlen must have the same number of batches")
    topk = topk.to(torch.int64)
    offsets = torch.arange(block_size)
    outs, maxs, sums, lses = [], [], [], []
    for qs, sq, ks, skv in zip(_starts(q_lens), q_lens, _starts(kv_lens), kv_lens):
        if sq == 0:
            continue
        qb = q[qs:qs + sq]  # [Sq, N1, D]
        kb = k[ks:ks + skv].repeat_interleave(g, dim=1)  # [Skv, N1, D]: query head h uses KV head h // G
        vb = v[ks:ks + skv].repeat_interleave(g, dim=1)  # [Skv, N1, Dv]
        dense = torch.einsum("ihd,jhd->ihj", qb, kb) * scale  # [Sq, N1, Skv]
        blocks = topk[qs:qs + sq]
        inside = ((blocks >= 0) & (blocks < skv // block_size)).unsqueeze(-1).expand(*blocks.shape, block_size)
        pos = (blocks.clamp(0, max(skv // block_size - 1, 0)).unsqueeze(-1) * block_size + offsets).flatten(2)
        pos = pos.repeat_interleave(g, dim=1)  # [Sq, N1, L] local; an index outside the blocks selects nothing
        inside = inside.flatten(2).repeat_interleave(g, dim=1)
        s = dense.gather(-1, pos)  # selected scores in top-k order, duplicates kept
        if causal:
            visible = inside & (pos <= torch.arange(sq).view(sq, 1, 1))
        else:
            visible = inside
        valid = visible.any(dim=-1, keepdim=True)
        s = torch.where(visible, s, torch.full_like(s, -math.inf))
        mx = s.detach().amax(dim=-1, keepdim=True)
        mx_safe = torch.where(valid, mx, torch.zeros_like(mx))
        e = torch.where(visible, torch.exp(s - mx_safe), torch.zeros_like(s))
        l = e.sum(dim=-1, keepdim=True)
        p = e / torch.where(valid, l, torch.ones_like(l))  # fully-masked rows: all 0
        heads = torch.arange(n1).view(1, n1, 1)
        outs.append(torch.einsum("ihl,ihld->ihd", p, vb[pos, heads]))  # the selected values only
        maxs.append(torch.where(valid, mx.to(sdt), FLT_LOWEST).squeeze(-1))
        sums.append(torch.where(valid, l.detach().to(sdt), FLT_MAX).squeeze(-1))
        lses.append(torch.where(valid, mx_safe + torch.where(valid, l, torch.ones_like(l)).log(), 0).squeeze(-1))
    tail = t1 - sum(q_lens)
    out = torch.cat(outs + [q.new_zeros((tail, n1, dv))])
    smax = torch.cat(maxs + [torch.full((tail, n1), FLT_LOWEST, dtype=sdt)])
    ssum = torch.cat(sums + [torch.full((tail, n1), FLT_MAX, dtype=sdt)])
    stats = out, smax.unsqueeze(-1).repeat(1, 1, LANES), ssum.unsqueeze(-1).repeat(1, 1, LANES)
    return (*stats, torch.cat(lses + [q.new_zeros((tail, n1))])) if return_lse else stats


def nsa_selected_attention_backward(dy: Tensor, q: Tensor, k: Tensor, v: Tensor, topk: Tensor, scale: float,
                                    block_size: int, actual_seq_qlen, actual_seq_kvlen, causal: bool, *,
                                    dtype: torch.dtype = torch.float64,
                                    attention_in: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` by autograd through :func:`nsa_selected_attention` in ``dtype``.

    With ``attention_in`` (the output given to the grad operator) the gradients are the operator's: it forms
    ``D = rowsum(dy * attention_in)`` from that output instead of the exact one, which adds
    ``P * (D_exact - D_given)`` to ``dS``: the gradient of ``sum_rows (D_exact - D_given) * lse``."""
    qq, kk, vv = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    out, _, _, lse = nsa_selected_attention(qq, kk, vv, topk, scale, block_size, actual_seq_qlen, actual_seq_kvlen,
                                            causal, dtype=dtype, return_lse=True)
    if not out.requires_grad:
        return torch.zeros_like(qq), torch.zeros_like(kk), torch.zeros_like(vv)
    loss = (out * dy.to(dtype)).sum()
    if attention_in is not None:
        d_exact = (out.detach() * dy.to(dtype)).sum(-1)
        d_given = (attention_in.to(dtype) * dy.to(dtype)).sum(-1)
        loss = loss + ((d_exact - d_given) * lse).sum()
    grads = torch.autograd.grad(loss, (qq, kk, vv), allow_unused=True)
    return tuple(torch.zeros_like(x) if gr is None else gr for gr, x in zip(grads, (qq, kk, vv)))


# ------------------------------------------------------------------------------------------------ compress attention
def importance_score_literal(p: Tensor, sel_len: int, m: int, nn: int) -> Tensor:
    """``score[..., k] = sum_{a<m} sum_{c<nn} p[..., m*(k+1) - a - c]`` (out-of-range columns contribute 0)."""
    cmp_len = p.shape[-1]
    cols = []
    for kk in range(sel_len):
        acc = p.new_zeros(p.shape[:-1])
        for a in range(m):
            for c in range(nn):
                idx = m * (kk + 1) - a - c
                if 0 <= idx < cmp_len:
                    acc = acc + p[..., idx]
        cols.append(acc)
    if not cols:
        return p.new_zeros(p.shape[:-1] + (0,))
    return torch.stack(cols, dim=-1)


def _slice_mask(mask: Tensor | None, rows: int, cols: int) -> Tensor:
    """Top-left ``[rows, cols]`` of a 2-D mask as bool (True = set); all False when ``mask`` is None."""
    if mask is None:
        return torch.zeros(rows, cols, dtype=torch.bool)
    return mask[:rows, :cols] != 0


def nsa_compress_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, scale: float, head_num: int, l: int, d: int,
                           l_sel: int, count: int, atten_mask, topk_mask, actual_seq_qlen, actual_cmp_seq_kvlen,
                           actual_sel_seq_kvlen, *, dtype: torch.dtype = torch.float64, return_scores: bool = False):
    """``(out [T, N1, Dv], topk_indices [T, N2, count] int32, softmax_max, softmax_sum)``.

    Per batch a dense softmax of ``scale * q k_cmp^T`` over the compressed keys, ``atten_mask`` (True = masked,
    top-left slice ``[:Sq_b, :CmpSkv_b]``); fully-masked rows give out 0 and invalid statistics. Importance
    ``score[k] = sum_{a<m} sum_{c<nn} P[m*(k+1)-a-c]`` (``m = l_sel // d``, ``nn = l // d``), summed over the GQA
    group; ``topk_mask`` (top-left ``[:Sq_b, :SelSkv_b]``) forces selection; descending score, ties to the lower
    index. Statistics ``[T, N1, 8]`` in the per-batch blocked memory order ``concat_b([N1, Sq_b, 8])``.
    With ``return_scores`` a fifth item is the list of per-batch ``[Sq_b, N2, SelSkv_b]`` scores (forced blocks
    at +inf).
    """
    q, kc, vc = q.to(dtype), k_cmp.to(dtype), v_cmp.to(dtype)
    t, n1, _ = q.shape
    if n1 != head_num:
        raise ValueError(f"head_num={head_num} != N1={n1}")
    n2 = kc.shape[1]
    g = n1 // n2
    dv = vc.shape[2]
    m, nn = l_sel // d, l // d
    sdt = _stat_dtype(dtype)
    q_lens = cum_to_lengths(actual_seq_qlen)
    c_lens = cum_to_lengths(actual_cmp_seq_kvlen)
    s_lens = cum_to_lengths(actual_sel_seq_kvlen)
    outs, maxs, sums, scores = [], [], [], []
    topk = torch.zeros(t, n2, count, dtype=torch.int32)
    for qs, sq, cs, cl, sl in zip(_starts(q_lens), q_lens, _starts(c_lens), c_lens, s_lens):
        if sq == 0:
            scores.append(torch.zeros(0, n2, sl, dtype=dtype))
            continue
        qb = q[qs:qs + sq].transpose(0, 1)  # [N1, Sq, D]
        kb = kc[cs:cs + cl].transpose(0, 1).repeat_interleave(g, dim=0)  # [N1, Cmp, D]
        vb = vc[cs:cs + cl].transpose(0, 1).repeat_interleave(g, dim=0)
        s = scale * (qb @ kb.transpose(-1, -2))  # [N1, Sq, Cmp]
        keep = ~_slice_mask(atten_mask, sq, cl).unsqueeze(0).expand_as(s)
        valid = keep.any(dim=-1, keepdim=True)
        s = torch.where(keep, s, torch.full_like(s, -math.inf))
        mx = s.amax(dim=-1, keepdim=True) if cl > 0 else torch.full((n1, sq, 1), -math.inf, dtype=dtype)
        mx_safe = torch.where(valid, mx, torch.zeros_like(mx))
        e = torch.where(keep, torch.exp(s - mx_safe), torch.zeros_like(s))
        sm = e.sum(dim=-1, keepdim=True)
        p = e / torch.where(valid, sm, torch.ones_like(sm))
        outs.append((p @ vb).transpose(0, 1))  # [Sq, N1, Dv]
        maxs.append(torch.where(valid, mx.detach().to(sdt), FLT_LOWEST).reshape(-1))
        sums.append(torch.where(valid, sm.detach().to(sdt), FLT_MAX).reshape(-1))

        per_head = importance_score_literal(p.detach(), sl, m, nn)  # [N1, Sq, Sel]
        score = per_head.reshape(n2, g, sq, sl).sum(dim=1).permute(1, 0, 2).clone()  # [Sq, N2, Sel]
        forced = _slice_mask(topk_mask, sq, sl)
        score = torch.where(forced.unsqueeze(1), torch.full_like(score, math.inf), score)
        scores.append(score)
        rows = score.tolist()
        for i in range(sq):
            for h2 in range(n2):
                row = rows[i][h2]
                order = sorted(range(sl), key=lambda kk: (-row[kk], kk))[:count]
                topk[qs + i, h2, :len(order)] = torch.tensor(order, dtype=torch.int32)
    used = sum(q_lens)
    outs.append(q.new_zeros((t - used, n1, dv)))
    out = torch.cat(outs)
    tail = (t - used) * n1
    smax = torch.cat(maxs + [torch.full((tail,), FLT_LOWEST, dtype=sdt)]).reshape(t, n1, 1).repeat(1, 1, LANES)
    ssum = torch.cat(sums + [torch.full((tail,), FLT_MAX, dtype=sdt)]).reshape(t, n1, 1).repeat(1, 1, LANES)
    if return_scores:
        return out, topk, smax, ssum, scores
    return out, topk, smax, ssum


def nsa_compress_attention_backward(dy: Tensor, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, *args,
                                    dtype: torch.dtype = torch.float64, **kwargs) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk_cmp, dv_cmp)`` of the attention output by autograd (the top-k output is not differentiable)."""
    qq, kk, vv = (x.detach().to(dtype).requires_grad_() for x in (q, k_cmp, v_cmp))
    out = nsa_compress_attention(qq, kk, vv, *args, dtype=dtype, **kwargs)[0]
    if not out.requires_grad:
        return torch.zeros_like(qq), torch.zeros_like(kk), torch.zeros_like(vv)
    grads = torch.autograd.grad(out, (qq, kk, vv), dy.to(dtype), allow_unused=True)
    return tuple(torch.zeros_like(x) if gr is None else gr for gr, x in zip(grads, (qq, kk, vv)))


def nsa_select_attention_infer(q: Tensor, k_cache: Tensor, v_cache: Tensor, topk: Tensor, block_table: Tensor,
                               kv_lens, scale: float, block_size: int, *, dtype: torch.dtype = torch.float64) -> Tensor:
    """``out [B, N1, Dv]`` for ``q [B, N1, D]`` (one token per request) and caches ``[blocks, page, N2, D]``.

    Request ``b``'s keys are rebuilt position by position from its pages (``block_table[b, p // page]``, slot
    ``p % page``) up to ``kv_lens[b]``. Query head ``h`` (KV head ``h // G``) attends to the concatenation of the
    blocks ``topk[b, h // G]`` in order, stopping at the first ``-1``, each block cut at the KV length (duplicates
    kept, nothing masked). A head that selects nothing gets 0. Unvalidated bad values select nothing: a negative
    index other than -1, positions past the length, positions in a block outside the cache.
    """
    batch, n1, _ = q.shape
    page, n2 = k_cache.shape[1], k_cache.shape[2]
    g = n1 // n2
    out = torch.zeros(batch, n1, v_cache.shape[-1], dtype=dtype)
    for b in range(batch):
        n = int(kv_lens[b])
        rows = [(int(block_table[b, p // page]), p % page) for p in range(n)]
        in_cache = [0 <= i < k_cache.shape[0] for i, _ in rows]
        kb = torch.stack([k_cache[i if ok else 0, j] for (i, j), ok in zip(rows, in_cache)]).to(dtype) if rows \
            else None  # [n, N2, D]
        vb = torch.stack([v_cache[i if ok else 0, j] for (i, j), ok in zip(rows, in_cache)]).to(dtype) if rows \
            else None
        for h in range(n1):
            pos = []
            for blk in topk[b, h // g].tolist():
                if blk == -1:
                    break
                pos += [p for p in range(blk * block_size, (blk + 1) * block_size) if 0 <= p < n and in_cache[p]]
            if not pos:
                continue
            idx = torch.tensor(pos)
            s = (kb[idx, h // g] @ q[b, h].to(dtype)) * scale
            out[b, h] = torch.softmax(s, 0) @ vb[idx, h // g]
    return out


def nsa_compress_attention_infer(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cmp_lens,
                                 scale: float, compress_block: int, stride: int, select_block: int, count: int, *,
                                 dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """``(out [B, N1, Dv], topk [B, N2, count])`` for ``q [B, N1, D]`` and compressed caches ``[blocks, page, N2, D]``.

    Per request: softmax attention over its ``S2`` compressed keys (rebuilt from its pages); selection block ``j - 1``
    (``j = 1 .. S2 - 1``) scores the probabilities ``P[idx]`` at ``idx = (select_block / stride) * j - a - c`` for
    every ``a < select_block / stride``, ``c < compress_block / stride`` with ``0 <= idx < S2``, summed over the GQA
    group; of the ``n = ceil(((S2 - 1) * stride + compress_block) / select_block)`` blocks, 0, ``n - 2`` and
    ``n - 1`` come first, then the best ``count - 3`` of blocks ``1 .. n - 3`` (descending, ties to the lower index).
    Keys in a block outside the cache (an unvalidated table) are not attended (probability 0).
    """
    batch, n1, _ = q.shape
    page, n2 = k_cache.shape[1], k_cache.shape[2]
    g = n1 // n2
    m, nn = select_block // stride, compress_block // stride
    out = torch.zeros(batch, n1, v_cache.shape[-1], dtype=dtype)
    topk = torch.zeros(batch, n2, count, dtype=torch.int32)
    for b in range(batch):
        s2 = int(cmp_lens[b])
        rows = [(int(block_table[b, p // page]), p % page) for p in range(s2)]
        hidden = torch.tensor([not 0 <= i < k_cache.shape[0] for i, _ in rows])  # a block outside the cache
        kb = torch.stack([k_cache[i if 0 <= i < k_cache.shape[0] else 0, j] for i, j in rows]).to(dtype)  # [S2, N2, D]
        vb = torch.stack([v_cache[i if 0 <= i < k_cache.shape[0] else 0, j] for i, j in rows]).to(dtype)
        probs = torch.stack([torch.softmax(((kb[:, h // g] @ q[b, h].to(dtype)) * scale).masked_fill(hidden, -math.inf),
                                           0) for h in range(n1)])
        for h in range(n1):
            out[b, h] = probs[h] @ vb[:, h // g]
        n = -(-((s2 - 1) * stride + compress_block) // select_block)
        score = torch.zeros(n2, max(n, s2), dtype=torch.float64)
        for j in range(1, s2):
            for a in range(m):
                for c in range(nn):
                    idx = m * j - a - c
                    if 0 <= idx < s2:
                        score[:, j - 1] += probs[:, idx].double().view(n2, g).sum(1)
        for h in range(n2):
            middle = sorted(range(1, n - 2), key=lambda k: (-float(score[h, k]), k))
            topk[b, h] = torch.tensor([0, n - 2, n - 1] + middle[:count - 3], dtype=torch.int32)
    return out, topk


def nsa_compress_infer_cache(kv: Tensor, weight: Tensor, slot_mapping: Tensor, block_table: Tensor, lens,
                             block: int, stride: int, cache: Tensor, *, dtype: torch.dtype = torch.float64) -> Tensor:
    """A new ``cache`` (computed in ``dtype``): for each request whose length ``L`` satisfies ``L >= block`` and
    ``(L - block) % stride == 0``, row ``slot_mapping[b]`` becomes ``sum_t weight[t, n] * kv_b[L - block + t, n]``,
    with ``kv_b`` the request's keys rebuilt from its pages of ``kv [blocks, page, N, D]``."""
    page = kv.shape[1]
    out = cache.to(dtype).clone()
    for b, n in enumerate(int(x) for x in lens):
        if n < block or (n - block) % stride:
            continue
        acc = torch.zeros(kv.shape[2:], dtype=dtype)
        for t in range(block):
            p = n - block + t
            acc += weight[t].to(dtype).unsqueeze(-1) * kv[int(block_table[b, p // page]), p % page].to(dtype)
        out[int(slot_mapping[b])] = acc
    return out


def nsa_selected_attention_grad_from_stats(dy: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, smax: Tensor,
                                           ssum: Tensor, topk: Tensor, scale: float, block_size: int,
                                           actual_seq_qlen, actual_seq_kvlen, causal: bool, *,
                                           dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` as the NPU grad forms them from given forward outputs: ``P = exp(S - max) / sum`` over the
    selected positions (causally visible ones only when ``causal``), ``dV = P^T dy``, ``dS = P (dy V^T - D)`` with
    ``D = rowsum(dy * out)``, ``dQ = scale dS K``, ``dK = scale dS^T Q`` (GQA: summed over the group). With the
    statistics of an unmasked forward and ``causal`` this is the NPU's mode-2 grad without an ``atten_mask``."""
    q, k, v, dy, out = (x.to(dtype) for x in (q, k, v, dy, out))
    n1, n2 = q.shape[1], k.shape[1]
    g = n1 // n2
    q_lens, kv_lens = cum_to_lengths(actual_seq_qlen), cum_to_lengths(actual_seq_kvlen)
    topk = topk.to(torch.int64)
    offsets = torch.arange(block_size)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qs, sq, ks, skv in zip(_starts(q_lens), q_lens, _starts(kv_lens), kv_lens):
        if sq == 0:
            continue
        qb, dyb = q[qs:qs + sq], dy[qs:qs + sq]
        kb = k[ks:ks + skv].repeat_interleave(g, dim=1)
        vb = v[ks:ks + skv].repeat_interleave(g, dim=1)
        dense = torch.einsum("ihd,jhd->ihj", qb, kb) * scale
        pos = (topk[qs:qs + sq].unsqueeze(-1) * block_size + offsets).flatten(2).repeat_interleave(g, dim=1)
        visible = pos <= torch.arange(sq).view(sq, 1, 1) if causal else torch.ones_like(pos, dtype=torch.bool)
        m = smax[qs:qs + sq, :, :1].to(dtype)
        l = ssum[qs:qs + sq, :, :1].to(dtype)
        p = torch.where(visible, torch.exp(dense.gather(-1, pos) - m) / l, torch.zeros((), dtype=dtype))
        p_dense = torch.zeros_like(dense).scatter_add(-1, pos, p)  # duplicates: their probabilities add
        d_row = (dyb * out[qs:qs + sq]).sum(-1, keepdim=True)
        ds = p_dense * (torch.einsum("ihd,jhd->ihj", dyb, vb) - d_row)
        dq[qs:qs + sq] = scale * torch.einsum("ihj,jhd->ihd", ds, kb)
        dk[ks:ks + skv] = (scale * torch.einsum("ihj,ihd->jhd", ds, qb)).unflatten(1, (n2, g)).sum(2)
        dv[ks:ks + skv] = torch.einsum("ihj,ihd->jhd", p_dense, dyb).unflatten(1, (n2, g)).sum(2)
    return dq, dk, dv
