"""Dense golden of the DSA operators and MLA helpers, written straight from the spec (DeepSeek sparse attention:
lightning indexer, sparse flash attention, the indexer's KL loss; interleaved RoPE, KV RMSNorm-RoPE).

Independent of :mod:`attnops.ops`: plain per-batch loops over the logical key sequence of each batch (the caller
passes it already gathered, ``keys[b] [Lk_b, D]``), computed in ``dtype`` (float64 for the golden, the low dtype
for the tolerance rule's baseline). Sparse attention's gradients come from autograd through
:func:`sparse_flash_attention`; the KL loss's are the spec's formulas (:func:`indexer_kl_loss_grad`).
"""
from __future__ import annotations

import torch
from torch import Tensor


def allowed(lq: int, lk: int, i: int, sparse_mode: int) -> int:
    """How many leading key positions query row ``i`` of a batch may use."""
    return lk if sparse_mode == 0 else max(0, min(lk, lk - lq + i + 1))


def lightning_scores(q: Tensor, k: Tensor, w: Tensor, dtype=torch.float64) -> Tensor:
    """``[Lq, Lk]`` scores ``sum_h w[i, h] relu(q[i, h] . k[j])`` of one batch (q ``[Lq, N, D]``, k ``[Lk, D]``)."""
    s = torch.einsum("ihd,jd->ihj", q.to(dtype), k.to(dtype)).clamp_min(0)
    return torch.einsum("ih,ihj->ij", w.to(dtype), s)


def lightning_indexer(q: Tensor, k: Tensor, w: Tensor, count: int, sparse_mode: int) -> list[list[int]]:
    """One batch's index rows: positions sorted by score descending (ties: smaller position), ``count`` long,
    -1 padded."""
    scores = lightning_scores(q, k, w)
    rows = []
    for i in range(q.shape[0]):
        a = allowed(q.shape[0], k.shape[0], i, sparse_mode)
        order = sorted(range(a), key=lambda j: (-float(scores[i, j]), j))[:count]
        rows.append(order + [-1] * (count - len(order)))
    return rows


def key_set(row: list[int], limit: int, block: int) -> list[int]:
    """Key positions a sparse-attention index row selects (first ``ceil(limit / block)`` entries, up to a -1)."""
    out = []
    for v in row[:min(len(row), -(-limit // block))]:
        if v < 0:
            break
        out += [p for p in range(v * block, v * block + block) if p < limit]
    return out


def sparse_flash_attention(q: Tensor, k: Tensor, v: Tensor, rows: list[list[int]], scale: float, *, sparse_mode=3,
                           block=1, q_rope=None, k_rope=None, sinks=None, dtype=torch.float64):
    """One batch: ``(out [Lq, N, Dv], max [Lq, N], sum [Lq, N])`` (q ``[Lq, N, D]``, k ``[Lk, D]``, v ``[Lk, Dv]``)."""
    lq, heads = q.shape[:2]
    outs, maxes, sums = [], [], []
    for i in range(lq):
        pos = key_set(rows[i], allowed(lq, k.shape[0], i, sparse_mode), block)
        if not pos and sinks is None:
            outs.append(torch.zeros(heads, v.shape[1], dtype=dtype))
            maxes.append(torch.zeros(heads, dtype=dtype))
            sums.append(torch.zeros(heads, dtype=dtype))
            continue
        idx = torch.tensor(pos, dtype=torch.long)
        logit = q[i].to(dtype) @ k[idx].to(dtype).T
        if q_rope is not None:
            logit = logit + q_rope[i].to(dtype) @ k_rope[idx].to(dtype).T
        logit = logit * scale
        full = logit if sinks is None else torch.cat([logit, sinks.to(dtype)[:, None]], 1)
        m = full.amax(1)
        e = torch.exp(full - m[:, None])
        l = e.sum(1)
        outs.append(e[:, :len(pos)] @ v[idx].to(dtype) / l[:, None])
        maxes.append(m)
        sums.append(l)
    return torch.stack(outs), torch.stack(maxes), torch.stack(sums)


def indexer_kl_loss_grad(q, k, qi, ki, w, rows, row_max, row_sum, scale, *, q_rope=None, k_rope=None,
                         dtype=torch.float64):
    """One batch's summed KL loss ``sum_t KL(P_t || softmax(I_t))`` over the first ``min(K, allowed)`` entries and
    the spec's gradients ``(loss, d_qi, d_ki, d_w)``: ``dI = Y - P`` (the clamps at 1e-8 enter the loss only),
    ``d_w = sum_r dI relu(S)``, ``dS = dI w [S > 0]``, ``d_qi = sum_r dS k_index``, ``d_ki`` scatter-added."""
    loss = torch.zeros((), dtype=dtype)
    d_qi, d_ki, d_w = (torch.zeros(x.shape, dtype=dtype) for x in (qi, ki, w))
    lq = q.shape[0]
    for t in range(lq):
        n = min(len(rows[t]), allowed(lq, k.shape[0], t, 3))
        if n == 0:
            continue
        idx = torch.tensor(rows[t][:n], dtype=torch.long)
        logit = q[t].to(dtype) @ k[idx].to(dtype).T
        if q_rope is not None:
            logit = logit + q_rope[t].to(dtype) @ k_rope[idx].to(dtype).T
        p = (torch.exp(logit * scale - row_max[t].to(dtype)[:, None]) / row_sum[t].to(dtype)[:, None]).mean(0)
        s = qi[t].to(dtype) @ ki[idx].to(dtype).T  # [G, n]
        y = torch.softmax((w[t].to(dtype)[:, None] * s.clamp_min(0)).sum(0), 0)
        pc, yc = p.clamp_min(1e-8), y.clamp_min(1e-8)
        loss = loss + (pc * (pc.log() - yc.log())).sum()
        d_i = y - p
        d_w[t] = s.clamp_min(0) @ d_i
        d_s = d_i[None, :] * w[t].to(dtype)[:, None] * (s > 0)
        d_qi[t] = d_s @ ki[idx].to(dtype)
        d_ki.index_add_(0, idx, d_s.T @ qi[t].to(dtype))
    return loss, d_qi, d_ki, d_w


def interleave_rope(x: Tensor, cos: Tensor, sin: Tensor, dtype=torch.float64) -> Tensor:
    """``cat(x_even, x_odd) * cos + cat(-x_odd, x_even) * sin`` in ``dtype`` (the output stays de-interleaved)."""
    x = x.to(dtype)
    e, o = x[..., 0::2], x[..., 1::2]
    return torch.cat([e, o], -1) * cos.to(dtype) + torch.cat([-o, e], -1) * sin.to(dtype)


def rms_norm(x: Tensor, gamma: Tensor, eps: float, dtype=torch.float64) -> Tensor:
    x = x.to(dtype)
    return gamma.to(dtype) * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def kv_cache_rows_v2(kv: Tensor, gamma: Tensor, cos: Tensor, sin: Tensor, v: Tensor, eps: float,
                     dtype=torch.float64) -> tuple[Tensor, Tensor]:
    """``npu_kv_rmsnorm_rope_cache``'s V2 rows ``[B, N, S, D]``: ``(RmsNorm(kv; gamma)`` over all of ``Dk`` with its
    first ``Dr`` (cos's width) dims rotated, ``v)``."""
    y = rms_norm(kv, gamma, eps, dtype)
    dr = cos.shape[-1]
    return torch.cat([interleave_rope(y[..., :dr], cos, sin, dtype), y[..., dr:]], -1), v.to(dtype)


def mla_prolog_int8(x, w_dq, w_uq_qr, w_uk, w_dkv_kr, gamma_cq, gamma_ckv, sin, cos, *, dequant_scale_w_uq_qr,
                    dequant_scale_x=None, dequant_scale_w_dq=None, dequant_scale_w_dkv_kr=None, smooth=None,
                    quant_scale_ckv=None, eps=1e-5) -> dict[str, Tensor]:
    """The MLA prolog's int8 paths in fp64, unrounded where the op rounds to int8 (``*_real``: the value whose
    round-half-even is the code). int8 ``x`` (with ``dequant_scale_x``) means W8A8 (``weight_quant_mode`` 2);
    ``quant_scale_ckv`` turns on the int8 cache and the per token-head query quantization."""
    f = torch.float64
    if x.dtype == torch.int8:
        xq = (x.to(f) @ w_dq.to(f)) * dequant_scale_x.to(f).reshape(-1, 1) * dequant_scale_w_dq.to(f).reshape(1, -1)
        kv = (x.to(f) @ w_dkv_kr.to(f)) * dequant_scale_x.to(f).reshape(-1, 1) * dequant_scale_w_dkv_kr.to(f).reshape(
            1, -1)
    else:
        xq, kv = x.to(f) @ w_dq.to(f), x.to(f) @ w_dkv_kr.to(f)
    c_q = rms_norm(xq, gamma_cq, eps) * (1 if smooth is None else smooth.to(f).reshape(-1))
    norm_scale = c_q.abs().amax(-1, keepdim=True) / 127
    codes = torch.round(c_q / norm_scale)
    n, d, hckv = w_uk.shape
    u = ((codes @ w_uq_qr.to(f)) * norm_scale * dequant_scale_w_uq_qr.to(f).reshape(1, -1)).view(x.shape[0], n, -1)
    query = torch.einsum("tnd,ndh->tnh", u[..., :d], w_uk.to(f))
    query_rope = interleave_rope(u[..., d:], cos[:, None], sin[:, None])
    latent = rms_norm(kv[:, :hckv], gamma_ckv, eps)
    out = {"query_norm_real": c_q / norm_scale, "dequant_scale_q_norm": norm_scale, "query": query,
           "query_rope": query_rope, "kv": latent, "kr": interleave_rope(kv[:, hckv:], cos, sin)}
    if quant_scale_ckv is not None:
        q_scale = query.abs().amax(-1, keepdim=True) / 127
        qs = float(quant_scale_ckv.reshape(()))
        out.update(query_real=query / q_scale, dequant_scale_q_nope=q_scale, query_rope=query_rope * qs / q_scale,
                   kv_real=latent * qs)
    return out
