"""Dense golden of the DeepSeek-V4 compressor, written straight from the spec: one batch at a time, one compressed
row at a time, every position's ``[kv | score]`` either computed from ``x`` or taken from the caller's history.

Independent of :mod:`attnops.ops`. Computed in ``dtype`` (float64 for the golden, the low dtype for the tolerance
rule's baseline).
"""
from __future__ import annotations

import torch
from torch import Tensor


def position_rows(x: Tensor, wkv: Tensor, wgate: Tensor, ape: Tensor, start_pos: int, dtype=torch.float64) -> Tensor:
    """``[n, 2 * coff * D]`` rows ``[x @ wkv.T | x @ wgate.T + ape[P % r]]`` of one batch's new tokens ``x [n, H]``
    at positions ``P = start_pos + t`` (what the state cache stores)."""
    r = ape.shape[0]
    rows = []
    for t in range(x.shape[0]):
        xt = x[t].to(dtype)
        kv = wkv.to(dtype) @ xt
        score = wgate.to(dtype) @ xt + ape[(start_pos + t) % r].to(dtype)
        rows.append(torch.cat([kv, score]))
    return torch.stack(rows) if rows else torch.zeros(0, 2 * wkv.shape[0], dtype=dtype)


def compress(x: Tensor, wkv: Tensor, wgate: Tensor, ape: Tensor, *, coff: int, start_pos: int = 0,
             history: Tensor | None = None, dtype=torch.float64) -> tuple[Tensor, Tensor]:
    """One batch: ``(compressed rows [count, D], new position rows [n, 2 * coff * D])``. ``history`` holds the rows of
    positions ``0..start_pos-1`` (only the ones the first window needs are read)."""
    r, n = ape.shape[0], x.shape[0]
    dim = wkv.shape[0] // coff
    new = position_rows(x, wkv, wgate, ape, start_pos, dtype)

    def row(p: int) -> Tensor:
        return new[p - start_pos] if p >= start_pos else history[p].to(dtype)

    out = []
    for j in range(start_pos // r, (start_pos + n) // r):
        kvs, scores = [], []
        for i in range(coff):
            block = j - coff + 1 + i
            for p in range(block * r, block * r + r):
                if p < 0:
                    continue  # before the sequence: weight 0
                kvs.append(row(p)[i * dim:(i + 1) * dim])
                scores.append(row(p)[coff * dim + i * dim:coff * dim + (i + 1) * dim])
        kv, score = torch.stack(kvs), torch.stack(scores)
        weight = torch.exp(score - score.max(0).values)
        out.append((weight * kv).sum(0) / weight.sum(0))
    return (torch.stack(out) if out else torch.zeros(0, dim, dtype=dtype)), new


def rms_norm_rope(rows: Tensor, weight: Tensor | None, sin: Tensor | None, cos: Tensor | None, *, eps: float,
                  rope_head_dim: int, rotary_mode: int, dtype=torch.float64) -> Tensor:
    """vllm-ascend's post-processing of compressed rows ``[R, D]``: ``rows / sqrt(mean(rows^2) + eps) * weight``, then
    RoPE of the last ``rope_head_dim`` columns (mode 2: pairs ``(2i, 2i+1)``; mode 1: halves) with
    ``sin/cos [R, d]``."""
    rows = rows.to(dtype)
    if weight is not None:
        rows = rows / torch.sqrt((rows * rows).mean(-1, keepdim=True) + eps) * weight.to(dtype)
    if sin is None:
        return rows
    out = rows.clone()
    d0, half = rows.shape[1] - rope_head_dim, rope_head_dim // 2
    for i in range(rope_head_dim // 2):
        a, b = (d0 + 2 * i, d0 + 2 * i + 1) if rotary_mode == 2 else (d0 + i, d0 + i + half)
        ia, ib = a - d0, b - d0
        out[:, a] = rows[:, a] * cos[:, ia].to(dtype) - rows[:, b] * sin[:, ia].to(dtype)
        out[:, b] = rows[:, b] * cos[:, ib].to(dtype) + rows[:, a] * sin[:, ib].to(dtype)
    return out
