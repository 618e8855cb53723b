"""Dense golden of CANN FlashAttention training (forward and backward), written straight from the spec.

Everything is computed in the ``dtype`` argument (float64 for the golden; float16/bfloat16/float32 for the
"plain PyTorch in low precision" baseline, with no upcasting). One dense ``[N1, Sq_b, Skv_b]`` score matrix
per batch, masks built from the table of ``cann_semantics.md`` §1.1, masked scores are ``-inf``.

Softmax statistics are returned in ``dtype`` for float32/float64 and in float32 for float16/bfloat16
(computed in the low dtype, only the container is fp32), because FLT_MAX / FLT_LOWEST of the invalid rows
are not representable in 16 bits.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

FLT_MAX = 3.4028234663852886e38
FLT_LOWEST = -FLT_MAX

__all__ = ["fa_forward", "fa_backward", "fa_backward_given_stats", "seq_lengths", "FLT_MAX", "FLT_LOWEST"]


def seq_lengths(cum) -> list[int]:
    """Per-batch lengths from a cumulative list (no leading 0); trailing zeros are empty batches."""
    cum = [int(x) for x in (cum.tolist() if isinstance(cum, Tensor) else cum)]
    last_nz = max((i for i, x in enumerate(cum) if x != 0), default=-1)
    lens, prev = [], 0
    for b, x in enumerate(cum):
        if b > last_nz:
            lens.append(0)
            continue
        if x < prev:
            raise ValueError(f"actual_seq lengths must be non-decreasing, got {cum}")
        lens.append(x - prev)
        prev = x
    return lens


def _to_bnsd(x: Tensor, layout: str, n: int) -> Tensor:
    """Dense layout -> [B, N, S, D]."""
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.permute(0, 2, 1, 3)
    if layout == "BSH":
        b, s, h = x.shape
        return x.reshape(b, s, n, h // n).permute(0, 2, 1, 3)
    if layout == "SBH":
        s, b, h = x.shape
        return x.reshape(s, b, n, h // n).permute(1, 2, 0, 3)
    raise ValueError(f"input_layout must be BSH, SBH, BSND, BNSD or TND, got {layout!r}")


def _from_bnsd(x: Tensor, layout: str) -> Tensor:
    """[B, N, S, D] -> dense layout."""
    b, n, s, d = x.shape
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.permute(0, 2, 1, 3)
    if layout == "BSH":
        return x.permute(0, 2, 1, 3).reshape(b, s, n * d)
    return x.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


def _keep_matrix(b, sq, skv, n1, *, atten_mask, sparse_mode, pre, nxt, prefix, band_idx) -> Tensor:
    """Boolean keep matrix [N1 or 1, Sq, Skv] of batch b (cann_semantics.md §1.1)."""
    i = torch.arange(sq).view(sq, 1)
    j = torch.arange(skv).view(1, skv)
    d = j - i
    delta = skv - sq
    if atten_mask is None:
        return torch.ones(1, sq, skv, dtype=torch.bool)

    def explicit():
        m = atten_mask
        if m.dim() == 4:
            m = m[b if m.shape[0] > 1 else 0]
        elif m.dim() == 2:
            m = m.unsqueeze(0)
        else:
            raise ValueError(f"atten_mask must be 2-D or 4-D, got shape {tuple(atten_mask.shape)}")
        return m[:, :sq, :skv] == 0

    causal_rd = d <= delta
    band_rd = (d - delta >= -pre) & (d - delta <= nxt)
    if sparse_mode == 0:
        k = explicit() & (d >= -pre) & (d <= nxt)
    elif sparse_mode == 1:
        k = explicit()
    elif sparse_mode == 2:
        k = d <= 0
    elif sparse_mode == 3:
        k = causal_rd
    elif sparse_mode == 4:
        k = band_rd
    elif sparse_mode == 5:
        k = explicit() & (causal_rd | (j < int(prefix[b])))
    elif sparse_mode == 6:
        k = causal_rd | (j < int(prefix[b]))
    elif sparse_mode == 7:
        k = band_rd if b == band_idx else causal_rd
    elif sparse_mode == 8:
        k = band_rd if b == band_idx else d <= 0
    else:
        raise ValueError(f"sparse_mode must be in 0..8, got {sparse_mode}")
    return k if k.dim() == 3 else k.unsqueeze(0)


def _alibi_block(comp, sq, skv, rows) -> Tensor:
    """Batch block of an ALiBi-compressed pse ``comp`` [N, 1024, W], as the CANN goldens build it.

    The compressed tensor is the last 1024 rows of a Toeplitz ``full`` [rows, W] (rows = max(1024, max Sq)); every
    diagonal of ``full`` is read from row 1023: ``full[x, y] = comp[1023, y + rows - 1 - x]``. A batch uses the
    bottom-right ``[Sq, Skv]`` block of ``full``; entries above the batch's diagonal (masked) are 0.
    """
    w = comp.shape[-1]
    x = torch.arange(rows - sq, rows).view(sq, 1)
    y = torch.arange(w - skv, w).view(1, skv)
    col = y + rows - 1 - x
    lower = torch.arange(skv).view(1, skv) <= torch.arange(sq).view(sq, 1)
    if bool(((col[lower] < 0) | (col[lower] >= w)).any()):
        raise ValueError("compressed pse is too narrow for these sequence lengths")
    col = torch.where(lower, col, torch.zeros_like(col))
    full = comp[:, 1023, :][:, col.reshape(-1)].reshape(comp.shape[0], sq, skv)
    return torch.where(lower, full, torch.zeros_like(full))


def _flat_pse_block(pse, b, n1, sq_list, skv_list) -> Tensor:
    """Batch b's block of a 1-D TND pse: segments ``[N1, 1, Skv_b]`` (length ``N1*sum(Skv_b)``) or
    ``[N1, Sq_b, Skv_b]`` (length ``N1*sum(Sq_b*Skv_b)``) one after another in batch order."""
    row_len = n1 * sum(skv_list)
    full_len = n1 * sum(a * c for a, c in zip(sq_list, skv_list))
    if pse.numel() not in (row_len, full_len):
        raise ValueError(f"1-D pse has {pse.numel()} elements, need {row_len} or {full_len}")
    rows = [1] * len(sq_list) if pse.numel() == row_len else list(sq_list)
    start = sum(n1 * rows[i] * skv_list[i] for i in range(b))
    block = pse[start:start + n1 * rows[b] * skv_list[b]].reshape(n1, rows[b], skv_list[b])
    return block.expand(n1, sq_list[b], skv_list[b])


def _pse_matrix(pse, b, sq, skv, n1, max_sq, tnd, pse_type, q_start, kv_start, dtype, lens) -> Tensor:
    """Additive bias [N1 or 1, Sq, Skv] of batch b (cann_semantics.md §2); ``lens`` = (Sq list, Skv list)."""
    if pse_type in (0, 1) and pse.dim() == 1:
        return _flat_pse_block(pse, b, n1, *lens)
    if pse_type in (2, 3):
        slope = (pse[b] if pse.dim() == 2 else pse).to(dtype).view(-1, 1, 1)
        i = torch.arange(sq).view(sq, 1)
        j = torch.arange(skv).view(1, skv)
        dist = ((j + kv_start) - (i + q_start)).abs().to(dtype)
        return -slope * (dist.sqrt() if pse_type == 3 else dist)
    p = pse[b if pse.shape[0] > 1 else 0]  # [N, R, C]
    if p.shape[-2] == 1024 and (tnd or max_sq > 1024):  # ALiBi-compressed (TND: whatever the lengths)
        return _alibi_block(p, sq, skv, max(1024, max_sq))
    if p.shape[-2] == 1:
        return p[:, :, :skv].expand(p.shape[0], sq, skv)
    return p[:, :sq, :skv]


def _scores(q, k, b, *, n1, scale, pse, pse_type, max_sq, tnd, q_start, kv_start, dtype, lens, softcap):
    """The unmasked scores ``[N1, Sq, Skv]`` of one batch (``k`` already repeated to the N1 heads)."""
    qk = q @ k.transpose(-1, -2)
    s = scale * qk
    if softcap > 0:  # flash-attn: scaled scores capped before the bias and the mask
        s = softcap * torch.tanh(s / softcap)
    if pse is not None:
        bias = _pse_matrix(pse, b, q.shape[1], k.shape[1], n1, max_sq, tnd, pse_type, q_start, kv_start, dtype,
                           lens)
        s = scale * (qk + bias) if pse_type == 1 else s + bias
    return s


def _batch(q, k, v, b, *, n1, scale, pse, pse_type, keep, max_sq, tnd, q_start, kv_start, dtype,
           drop_keep, keep_prob, drop_off, lens, softcap=0.0):
    """One batch: q [N1,Sq,D], k [N2,Skv,D], v [N2,Skv,Dv] -> out [N1,Sq,Dv], max, sum [N1,Sq]."""
    sq, skv = q.shape[1], k.shape[1]
    g = n1 // k.shape[0]
    k = k.repeat_interleave(g, dim=0)
    v = v.repeat_interleave(g, dim=0)
    s = _scores(q, k, b, n1=n1, scale=scale, pse=pse, pse_type=pse_type, max_sq=max_sq, tnd=tnd, q_start=q_start,
                kv_start=kv_start, dtype=dtype, lens=lens, softcap=softcap)
    keep = keep.expand(n1, sq, skv)
    valid = keep.any(dim=-1, keepdim=True)
    s_masked = torch.where(keep, s, torch.full_like(s, -math.inf))
    if skv > 0:
        m = s_masked.amax(dim=-1, keepdim=True)
    else:
        m = torch.full((n1, sq, 1), -math.inf, dtype=dtype)
    m_safe = torch.where(valid, m, torch.zeros_like(m))
    e = torch.where(keep, torch.exp(s_masked - m_safe), torch.zeros_like(s))
    l = e.sum(dim=-1, keepdim=True)
    # the probabilities from a constant shift: softmax does not depend on it, and autograd through the max would
    # route inf - inf = NaN to the argmax entry on rows with infinite scores (the statistics keep the max's gradient)
    e_p = torch.where(keep, torch.exp(s_masked - m_safe.detach()), torch.zeros_like(s))
    l_p = e_p.sum(dim=-1, keepdim=True)
    # masked entries are 0 even where l is NaN (non-finite inputs): a row never reaches a key it does not see
    p = torch.where(keep, e_p / torch.where(valid, l_p, torch.ones_like(l_p)), torch.zeros_like(e_p))
    if keep_prob < 1.0:
        n = n1 * sq * skv
        kb = drop_keep[drop_off:drop_off + n].reshape(n1, sq, skv).bool()
        p = torch.where(kb, p / keep_prob, torch.zeros_like(p))
    out = p @ v
    return out, m.squeeze(-1), l.squeeze(-1), valid.squeeze(-1)


def fa_forward(query, key, value, *, head_num: int, input_layout: str, pse=None, atten_mask=None,
               scale: float = 1.0, keep_prob: float = 1.0, drop_keep=None,
               pre_tokens: int = 2147483647, next_tokens: int = 2147483647, prefix=None,
               actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode: int = 0, pse_type: int = 1,
               q_start_idx: int = 0, kv_start_idx: int = 0, softmax_layout: str = "",
               softcap: float = 0.0, pse_bottom_right: bool = False,
               dtype=torch.float64) -> tuple[Tensor, Tensor, Tensor]:
    """Dense golden forward: returns (attention_out, softmax_max, softmax_sum). ``softcap`` > 0: scores
    ``softcap * tanh(scale*QK^T / softcap)`` before the pse (types 0/2/3) and the mask; ``pse_bottom_right``: ALiBi
    slopes with query positions from ``Skv - Sq + q_start_idx`` in every batch (flash-attn's alignment)."""
    q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)
    if pse is not None:
        pse = pse.to(dtype)
    if keep_prob < 1.0 and drop_keep is None:
        raise ValueError("keep_prob < 1 needs drop_keep")
    stat_dtype = torch.promote_types(dtype, torch.float32)
    tnd = input_layout == "TND"

    if tnd:
        n1, n2 = q.shape[1], k.shape[1]
        lq, lk = seq_lengths(actual_seq_qlen), seq_lengths(actual_seq_kvlen)
        if len(lq) != len(lk):
            raise ValueError("actual_seq_qlen and actual_seq_kvlen must have the same length")
        sq_list, skv_list = lq, lk
        q_off = [sum(lq[:b]) for b in range(len(lq))]
        k_off = [sum(lk[:b]) for b in range(len(lk))]
        qs = [q[o:o + s].transpose(0, 1) for o, s in zip(q_off, lq)]
        ks = [k[o:o + s].transpose(0, 1) for o, s in zip(k_off, lk)]
        vs = [v[o:o + s].transpose(0, 1) for o, s in zip(k_off, lk)]
    else:
        d = q.shape[-1] if input_layout in ("BSND", "BNSD") else q.shape[-1] // head_num
        qb = _to_bnsd(q, input_layout, head_num)
        n2 = key.shape[-1] // d if input_layout in ("BSH", "SBH") else None
        kb = _to_bnsd(k, input_layout, n2)
        vb = _to_bnsd(v, input_layout, kb.shape[1])
        n1 = qb.shape[1]
        bsz = qb.shape[0]
        sq_list, skv_list = [qb.shape[2]] * bsz, [kb.shape[2]] * bsz
        qs, ks, vs = list(qb), list(kb), list(vb)
    if n1 != head_num:
        raise ValueError(f"head_num={head_num} does not match the query's {n1} heads")
    nb = len(sq_list)
    nonempty = [b for b in range(nb) if sq_list[b] > 0]
    band_idx = (nonempty[-1] if sparse_mode == 7 else nonempty[0]) if nonempty else -1
    max_sq = max(sq_list, default=0)
    numels = n1 * sum(a * c for a, c in zip(sq_list, skv_list))
    if keep_prob < 1.0 and drop_keep.numel() < numels:  # trailing padding is ignored
        raise ValueError(f"drop_keep has {drop_keep.numel()} elements, need {numels}")

    outs, maxs, sums = [], [], []
    drop_off = 0
    for b in range(nb):
        sq, skv = sq_list[b], skv_list[b]
        keep = _keep_matrix(b, sq, skv, n1, atten_mask=atten_mask, sparse_mode=sparse_mode,
                            pre=pre_tokens, nxt=next_tokens, prefix=prefix, band_idx=band_idx)
        reset = tnd and sparse_mode == 8 and b != 0 and not pse_bottom_right
        q_start = 0 if reset else q_start_idx + (skv - sq if pse_bottom_right else 0)
        o, m, l, valid = _batch(qs[b], ks[b], vs[b], b, n1=n1, scale=scale, pse=pse, pse_type=pse_type,
                                keep=keep, max_sq=max_sq, tnd=tnd, q_start=q_start,
                                kv_start=0 if reset else kv_start_idx, dtype=dtype,
                                drop_keep=drop_keep, keep_prob=keep_prob, drop_off=drop_off,
                                lens=(sq_list, skv_list), softcap=softcap)
        drop_off += n1 * sq * skv
        m = torch.where(valid, m.to(stat_dtype), torch.full_like(m, FLT_LOWEST, dtype=stat_dtype))
        l = torch.where(valid, l.to(stat_dtype), torch.full_like(l, FLT_MAX, dtype=stat_dtype))
        outs.append(o)
        maxs.append(m)
        sums.append(l)

    if not tnd:
        out = _from_bnsd(torch.stack(outs), input_layout)
        smax = torch.stack(maxs).unsqueeze(-1).repeat(1, 1, 1, 8)
        ssum = torch.stack(sums).unsqueeze(-1).repeat(1, 1, 1, 8)
        return out, smax, ssum

    t = q.shape[0]
    dv = v.shape[-1]
    used = sum(sq_list)
    out = torch.cat([o.transpose(0, 1) for o in outs] + [torch.zeros(t - used, n1, dv, dtype=dtype)])

    def pack(stats, fill):
        tail = torch.full((t - used, n1), fill, dtype=stat_dtype)
        if softmax_layout == "TND":
            x = torch.cat([s.transpose(0, 1) for s in stats] + [tail])
        elif softmax_layout == "":
            x = torch.cat([s.reshape(-1) for s in stats] + [tail.reshape(-1)]).reshape(t, n1)
        else:
            raise ValueError(f"softmax_layout must be '' or 'TND', got {softmax_layout!r}")
        return x.unsqueeze(-1).repeat(1, 1, 8)

    return out, pack(maxs, FLT_LOWEST), pack(sums, FLT_MAX)


def fa_backward(dy, query, key, value, attention_in=None, **kwargs) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients (dq, dk, dv, dpse) by autograd through :func:`fa_forward` in ``dtype``.

    dpse (same shape as ``pse``) only for pse_type 0/1 with a pse tensor, else None. With ``attention_in`` (the
    output given to the backward operator), the gradients are the operator's: it forms
    ``D = rowsum(dy * attention_in)`` from that output instead of the exact one, which adds
    ``P * (D_exact - D_given)`` to ``dS``: the gradient of ``sum_rows (D_exact - D_given) * lse`` (``d lse / d s = P``).
    """
    dtype = kwargs.get("dtype", torch.float64)
    q = query.detach().to(dtype).requires_grad_()
    k = key.detach().to(dtype).requires_grad_()
    v = value.detach().to(dtype).requires_grad_()
    inputs = [q, k, v]
    pse = kwargs.get("pse")
    want_dpse = pse is not None and kwargs.get("pse_type", 1) in (0, 1)
    if want_dpse:
        pse = pse.detach().to(dtype).requires_grad_()
        kwargs = {**kwargs, "pse": pse}
        inputs.append(pse)
    out, smax, ssum = fa_forward(q, k, v, **{**kwargs, "softmax_layout": "TND"})
    loss = (out * dy.to(dtype)).sum()
    if attention_in is not None:
        layout, heads = kwargs["input_layout"], kwargs["head_num"]
        rows = (lambda x: x if layout == "TND" else _to_bnsd(x, layout, heads))
        d_exact = (rows(out.detach()) * rows(dy.to(dtype))).sum(-1)
        d_given = (rows(attention_in.to(dtype)) * rows(dy.to(dtype))).sum(-1)
        lse = smax[..., 0] + ssum[..., 0].log()
        loss = loss + ((d_exact - d_given).to(lse.dtype) * lse).sum()
    if loss.requires_grad:
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    else:
        grads = [None] * len(inputs)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]
    return grads[0], grads[1], grads[2], (grads[3] if want_dpse else None)


def fa_backward_given_stats(dy, query, key, value, attention_in, softmax_max, softmax_sum, *, head_num: int,
                            input_layout: str, pse=None, atten_mask=None, scale: float = 1.0,
                            pre_tokens: int = 2147483647, next_tokens: int = 2147483647, prefix=None,
                            sparse_mode: int = 0, pse_type: int = 1, q_start_idx: int = 0, kv_start_idx: int = 0,
                            dtype=torch.float64) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of the backward operator from the statistics and the output it is GIVEN (as the NPU
    computes them, nothing recomputed from q/k): per query row, over the keys it sees (``P`` is 0 elsewhere),
    ``P = exp(S - softmax_max) / softmax_sum``, ``D = rowsum(dy * attention_in)``, ``dV = P^T dy``,
    ``dS = P * (dy V^T - D)``, ``dQ = scale * dS K``, ``dK = scale * dS^T Q`` (summed over a key's query group).
    ``softmax_max``/``softmax_sum`` ``[B, N1, Sq, 8]``; layouts BSH, SBH, BSND, BNSD; no dropout, no softcap."""
    if input_layout == "TND":
        raise ValueError("fa_backward_given_stats takes the dense layouts (BSH, SBH, BSND, BNSD)")
    q = _to_bnsd(query.to(dtype), input_layout, head_num)
    d = q.shape[-1]
    k = _to_bnsd(key.to(dtype), input_layout, key.shape[-1] // d if input_layout in ("BSH", "SBH") else None)
    v = _to_bnsd(value.to(dtype), input_layout, k.shape[1])
    dy, out = (_to_bnsd(x.to(dtype), input_layout, head_num) for x in (dy, attention_in))
    bsz, n1, sq = q.shape[:3]
    n2, skv = k.shape[1], k.shape[2]
    g = n1 // n2
    band_idx = (bsz - 1 if sparse_mode == 7 else 0) if sq > 0 else -1
    if pse is not None:
        pse = pse.to(dtype)
    dqs, dks, dvs = [], [], []
    for b in range(bsz):
        keep = _keep_matrix(b, sq, skv, n1, atten_mask=atten_mask, sparse_mode=sparse_mode, pre=pre_tokens,
                            nxt=next_tokens, prefix=prefix, band_idx=band_idx).expand(n1, sq, skv)
        kr, vr = k[b].repeat_interleave(g, 0), v[b].repeat_interleave(g, 0)
        s = _scores(q[b], kr, b, n1=n1, scale=scale, pse=pse, pse_type=pse_type, max_sq=sq, tnd=False,
                    q_start=q_start_idx, kv_start=kv_start_idx, dtype=dtype, lens=([sq] * bsz, [skv] * bsz),
                    softcap=0.0)
        m, l = softmax_max[b, ..., :1].to(dtype), softmax_sum[b, ..., :1].to(dtype)
        zero = torch.zeros_like(s)
        p = torch.where(keep, torch.exp(s - m) / l, zero)
        rows = (dy[b] * out[b]).sum(-1, keepdim=True)
        ds = torch.where(keep, p * (dy[b] @ vr.transpose(-1, -2) - rows), zero)
        dqs.append(scale * ds @ kr)
        dks.append((scale * ds.transpose(-1, -2) @ q[b]).unflatten(0, (n2, g)).sum(1))
        dvs.append((p.transpose(-1, -2) @ dy[b]).unflatten(0, (n2, g)).sum(1))
    return tuple(_from_bnsd(torch.stack(x), input_layout) for x in (dqs, dks, dvs))
