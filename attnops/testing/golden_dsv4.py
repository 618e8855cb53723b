"""Dense golden of DeepSeek-V4's sparse flash MLA (sliding window + compressed / compressed-sparse keys, one softmax
with a per-head sink), written straight from the spec.

Independent of :mod:`attnops.ops`: one batch at a time, one query row at a time, with Python lists of visible key
positions. The caller passes the batch's logical sequences (``q [Lq, N, D]``, ``ori [Lori, D]``, ``cmp [Lcmp, D]``)
and index rows as lists. Computed in ``dtype`` (float64 for the golden); gradients come from autograd through it.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def ori_positions(lq: int, lori: int, i: int, mode: int, win_left: int, win_right: int) -> list[int]:
    """Ori keys of query row ``i``: the row sits at ``p = Lori - Lq + i``; mode 0 all, 3 ``[0, p + right]``,
    4 ``[p - left, p + right]`` (a window of -1 is unbounded), within ``[0, Lori)``."""
    p = lori - lq + i
    if mode == 0:
        return list(range(lori))
    first = 0 if mode == 3 or win_left == -1 else p - win_left
    last = lori - 1 if win_right == -1 else p + win_right
    return [j for j in range(lori) if first <= j <= last]


def cmp_threshold(lq: int, lcmp: int, i: int, ratio: int, mode: int, mask_len: int) -> int:
    """How many leading compressed keys row ``i`` may see: ``floor((Lcm - Lq + i + 1) / r)`` (mode 3) or
    ``floor(Lcm / r)`` (mode 0), at most ``Lcmp`` and at least 0."""
    n = math.floor((mask_len - lq + i + 1) / ratio) if mode == 3 else mask_len // ratio
    return max(0, min(n, lcmp))


def cmp_positions(thr: int, index_row: list[int] | None) -> list[int]:
    """The compressed keys a row sees: the prefix ``[0, thr)`` (no indices), or of its index row the first
    ``min(K, thr)`` entries up to the first -1, those below ``thr``, duplicates kept."""
    if index_row is None:
        return list(range(thr))
    out = []
    for v in index_row[:thr]:
        if v == -1:
            break
        if v < thr:
            out.append(v)
    return out


def sparse_flash_mla(q: Tensor, ori: Tensor, cmp: Tensor | None, index_rows: list[list[int]] | None,
                     sinks: Tensor | None, scale: float, *, ratio: int = 1, ori_mask_mode: int = 4,
                     win_left: int = 127, win_right: int = 0, cmp_mask_mode: int = 3, residual: int | None = None,
                     dtype=torch.float64) -> tuple[Tensor, Tensor]:
    """One batch: ``(out [Lq, N, D], lse [Lq, N])``. A row that sees no key gives zeros in both."""
    lq, heads, _ = q.shape
    if lq == 0:
        return torch.zeros(0, heads, q.shape[2], dtype=dtype), torch.zeros(0, heads, dtype=dtype)
    lori, lcmp = ori.shape[0], 0 if cmp is None else cmp.shape[0]
    mask_len = lori if residual is None else lcmp * ratio + residual
    outs, lses = [], []
    for i in range(lq):
        keys = [ori[j] for j in ori_positions(lq, lori, i, ori_mask_mode, win_left, win_right)]
        if cmp is not None:
            thr = cmp_threshold(lq, lcmp, i, ratio, cmp_mask_mode, mask_len)
            keys += [cmp[c] for c in cmp_positions(thr, None if index_rows is None else index_rows[i])]
        if not keys:
            outs.append(torch.zeros(heads, q.shape[2], dtype=dtype))
            lses.append(torch.zeros(heads, dtype=dtype))
            continue
        k = torch.stack(keys).to(dtype)
        logits = scale * (q[i].to(dtype) @ k.T)
        if sinks is not None:
            logits = torch.cat([logits, sinks.to(dtype)[:, None]], 1)
        lse = torch.logsumexp(logits, 1)
        prob = torch.exp(logits - lse[:, None])
        outs.append(prob[:, :k.shape[0]] @ k)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)
