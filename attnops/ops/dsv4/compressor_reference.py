"""DeepSeek-V4 compressor, CPU reference (C4A: ``cmp_ratio`` 4, ``coff`` 2; C4Li: the same for the indexer's 128-wide
keys; C128A: ``cmp_ratio`` 128, ``coff`` 1).

Per position ``P``: ``kv[P] = x @ wkv.T`` and ``score[P] = x @ wgate.T + ape[P % r]`` (``coff * D`` wide); positions
before ``start_pos`` come from the state cache. Compressed row ``j`` is a softmax-weighted sum, per column, over a
window of ``coff`` blocks of ``r`` positions: block ``j - coff + 1 + i`` contributes its columns
``[i * D, (i + 1) * D)`` (so with ``coff`` 2 the previous block uses the first half and block ``j`` the second half;
positions before 0 weigh 0). Then, optionally, RMSNorm with ``norm_weight`` and RoPE of the last ``rope_head_dim``
columns (vllm-ascend's form). Every new position's ``[kv | score]`` is saved to the state (see
:mod:`.compressor_problem` for where).

The state cache may be a strided view (e.g. one layer of a larger buffer). The state rows the call reads are
gathered before anything is written (the NPU's in-place update gives the same).
New tokens are taken in chunks of whole blocks, so memory stays linear in the chunk, not the sequence. Compute in
fp32 (fp64 for fp64 inputs); outputs in ``x``'s dtype.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..common.rotary import rotate_half, rotate_interleaved
from .compressor_problem import CompressorProblem

CHUNK_TOKENS = 2048


def compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def compressor_forward(problem: CompressorProblem, x: Tensor, wkv: Tensor, wgate: Tensor, state_cache: Tensor,
                       ape: Tensor, norm_weight: Tensor | None, rope_sin: Tensor | None, rope_cos: Tensor | None,
                       rope_head_dim: int, norm_eps: float, rotary_mode: int) -> Tensor:
    """The compressed rows (``problem.out_shape``, ``x``'s dtype; padding rows 0); ``state_cache`` is updated in
    place."""
    dt = compute_dtype(x)
    r, width = problem.ratio, problem.coff * problem.dim
    flat_x = x.reshape(-1, x.shape[-1])
    w = torch.cat([wkv, wgate]).to(dt)
    prefixes = [_prefix(problem, b, state_cache, dt) for b in range(len(problem.batches))]  # all reads, then writes
    out = torch.zeros(*problem.out_shape, dtype=dt)
    flat_out = out.view(-1, problem.dim)
    step = r * max(1, CHUNK_TOKENS // r)
    for b, batch in enumerate(problem.batches):
        carry, row = prefixes[b], batch.out_start
        for t0 in range(0, batch.n, step):
            pos = torch.arange(batch.start_pos + t0, batch.start_pos + min(batch.n, t0 + step))
            rows = torch.matmul(flat_x[batch.x_start + t0:batch.x_start + t0 + pos.numel()].to(dt), w.T)
            rows[:, width:] += ape.to(dt)[pos % r]
            _save(problem, b, pos, rows, state_cache)
            seq = torch.cat([carry, rows]) if carry is not None else rows
            blocks = seq.shape[0] // r
            if carry is not None and blocks >= problem.coff:
                emitted = _compress(seq[:blocks * r].view(blocks, r, 2 * width), problem.coff, problem.dim)
                flat_out[row:row + emitted.shape[0]] = emitted
                row += emitted.shape[0]
            if carry is not None:
                carry = seq[(blocks - problem.coff + 1) * r:]
    if norm_weight is not None or rope_sin is not None:
        valid = torch.tensor([i for b in problem.batches for i in range(b.out_start, b.out_start + b.emitted(r))],
                             dtype=torch.int64)
        sin, cos = ((None, None) if rope_sin is None else
                    (t.reshape(-1, rope_head_dim)[valid] for t in (rope_sin, rope_cos)))
        flat_out[valid] = _post(flat_out[valid], norm_weight, sin, cos, rope_head_dim, norm_eps, rotary_mode)
    return out.to(x.dtype)


def _prefix(problem: CompressorProblem, b: int, state: Tensor, dt: torch.dtype) -> Tensor | None:
    """Batch ``b``'s rows ``[kv | score]`` from the block start ``(start_pos // r - coff + 1) * r`` to ``start_pos``:
    state rows, and ``kv = 0, score = -inf`` before position 0; None when the batch emits no row (nothing to read)."""
    batch, r = problem.batches[b], problem.ratio
    if batch.emitted(r) == 0:
        return None
    base = (batch.start_pos // r - problem.coff + 1) * r
    rows = torch.zeros(batch.start_pos - base, state.shape[-1], dtype=dt)
    before = max(0, -base)
    rows[:before, rows.shape[1] // 2:] = float("-inf")
    pos = torch.arange(base + before, batch.start_pos)
    if pos.numel():
        block, slot = problem.slots(b, pos)
        rows[before:] = state[block, slot].to(dt)
    return rows


def _save(problem: CompressorProblem, b: int, pos: Tensor, rows: Tensor, state: Tensor) -> None:
    keep = problem.writes(b, pos)
    if bool(keep.any()):
        block, slot = problem.slots(b, pos[keep])
        state[block, slot] = rows[keep].to(state.dtype)


def _compress(blocks: Tensor, coff: int, dim: int) -> Tensor:
    """``[K, r, 2 * coff * D]`` consecutive blocks -> the ``K - coff + 1`` compressed rows ``[.., D]`` of the blocks
    that end a full window."""
    count, width = blocks.shape[0] - coff + 1, coff * dim
    kv = torch.cat([blocks[i:i + count, :, i * dim:(i + 1) * dim] for i in range(coff)], dim=1)
    score = torch.cat([blocks[i:i + count, :, width + i * dim:width + (i + 1) * dim] for i in range(coff)], dim=1)
    return (torch.softmax(score, dim=1) * kv).sum(1)


def _post(out: Tensor, norm_weight: Tensor | None, rope_sin: Tensor | None, rope_cos: Tensor | None,
          rope_head_dim: int, norm_eps: float, rotary_mode: int) -> Tensor:
    """Compressed rows ``[R, D]`` -> RMSNorm (mean over D, ``eps`` inside the root) times ``norm_weight``, then
    RoPE on the last ``rope_head_dim`` columns with the rows' ``rope_sin/cos [R, rope_head_dim]``: mode 2 rotates
    pairs ``(2i, 2i+1)``, mode 1 the halves."""
    if norm_weight is not None:
        out = out * torch.rsqrt(out.square().mean(-1, keepdim=True) + norm_eps) * norm_weight.to(out.dtype)
    if rope_sin is None:
        return out
    nope, rope = out[..., :-rope_head_dim], out[..., -rope_head_dim:]
    rotate = rotate_interleaved if rotary_mode == 2 else rotate_half
    rope = rotate(rope, rope_cos.to(out.dtype), rope_sin.to(out.dtype))
    return torch.cat([nope, rope], dim=-1)
