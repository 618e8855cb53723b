"""DeepSeek-V4 compressor: argument validation and the call's normal form (per batch: its new tokens in ``x``, their
absolute start position, where its compressed rows go, and where each logical position lives in the state cache).

``x`` ``[B, S, H]`` or packed ``[T, H]`` (with ``cu_seqlens [B+1]``, leading 0); ``seqused [B]`` new tokens per batch
(at most the segment); ``start_pos [B]`` the absolute position of each batch's first new token. A batch emits one
compressed row per block of ``cmp_ratio`` positions that ends inside the call: blocks ``start_pos // r`` to
``(start_pos + n) // r - 1``. Output rows: ``[B, ceil(S / r), D]`` (each batch's rows, then padding) or packed
``[min(T, T // r + B), D]`` (all batches' rows in batch order, then padding).

State cache ``[blocks, block_size, 2 * coff * D]`` (last dim ``[kv | score]``, the score with ``ape`` added). Logical
position ``P`` of batch ``b`` lives at slot ``P % block_size`` of block ``state_block_table[b, P // block_size]``
(``cache_mode`` 1; entry 0 means "do not write") or of block ``state_block_table[b]`` (``cache_mode`` 2, a ring
buffer of at least ``coff * r`` slots). Without a block table there is no state: every ``start_pos`` must be 0 and
nothing is saved.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..._core.checks import check_choice, check_int, check_same_device, check_tensor, fail, require
from ..._core.varlen import INDEX_DTYPES, check_index_vector, host_ints, per_batch, segments, used

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
STATE_DTYPES = (torch.float32, torch.float64)
COFFS = (1, 2)
CACHE_MODES = (1, 2)
ROTARY_MODES = (1, 2)


@dataclass(frozen=True)
class Batch:
    """One batch: its new tokens are rows ``[x_start, x_start + n)`` of the flat ``x``, at absolute positions
    ``start_pos + t``; its compressed rows go to flat output rows ``[out_start, out_start + emitted)``."""
    x_start: int
    n: int
    start_pos: int
    out_start: int

    def emitted(self, ratio: int) -> int:
        return (self.start_pos + self.n) // ratio - self.start_pos // ratio


@dataclass(frozen=True)
class CompressorProblem:
    """A compressor call in normal form: the batches, the output shape, the compression attributes and the state
    map (``table`` int64 ``[B, max_blocks]`` or ``[B]``, None without a state)."""
    batches: tuple[Batch, ...]
    out_shape: tuple[int, ...]
    ratio: int
    coff: int
    dim: int
    cache_mode: int
    table: Tensor | None
    block_size: int

    def slots(self, b: int, pos: Tensor) -> tuple[Tensor, Tensor]:
        """``(block, slot)`` indices into the state cache of batch ``b``'s logical positions ``pos >= 0``."""
        block = self.table[b].expand(pos.shape) if self.cache_mode == 2 else self.table[b, pos // self.block_size]
        return block, pos % self.block_size

    def writes(self, b: int, pos: Tensor) -> Tensor:
        """Which of batch ``b``'s new positions ``pos`` are saved to the state."""
        if self.table is None:
            return torch.zeros_like(pos, dtype=torch.bool)
        if self.cache_mode == 2:
            batch = self.batches[b]
            tail = (batch.start_pos + batch.n) // self.ratio * self.ratio - (self.coff - 1) * self.ratio
            return pos >= tail
        return self.table[b, pos // self.block_size] != 0


def output_shape(x: Tensor, wkv: Tensor, cu_seqlens: Tensor | None, cmp_ratio: int, coff: int) -> tuple[int, ...]:
    """The compressed rows' shape (from shapes only, as the fake kernel needs it)."""
    dim = wkv.shape[0] // coff
    if x.dim() == 3:
        return (x.shape[0], -(-x.shape[1] // cmp_ratio), dim)
    require(cu_seqlens is not None, "cu_seqlens", "cu_seqlens [B+1] (required with a packed x [T, H])", None)
    batch = cu_seqlens.shape[0] - 1
    return (min(x.shape[0], x.shape[0] // cmp_ratio + batch), dim)


def check_operands(x: Tensor, wkv: Tensor, wgate: Tensor, state_cache: Tensor, ape: Tensor, *, norm_weight,
                   rope_sin, rope_cos, state_block_table, cu_seqlens, cmp_ratio: int, coff: int, cache_mode: int,
                   rope_head_dim: int, norm_eps: float, rotary_mode: int) -> tuple[int, int, tuple[int, ...]]:
    """The checks that read no metadata value (attributes, the operands' shapes, dtypes and devices, the optional
    RMSNorm and RoPE); returns ``(cmp_ratio, D, output shape)``."""
    check_same_device("x", x, wkv=wkv, wgate=wgate, state_cache=state_cache, ape=ape, norm_weight=norm_weight,
                      rope_sin=rope_sin, rope_cos=rope_cos, state_block_table=state_block_table)
    ratio = check_int("cmp_ratio", cmp_ratio, lo=1)
    check_choice("coff", coff, COFFS)
    check_choice("cache_mode", cache_mode, CACHE_MODES)
    check_tensor("x", x, ndim=(2, 3), dtypes=FLOAT_DTYPES)
    hidden = x.shape[-1]
    check_tensor("wkv", wkv, ndim=2, dtypes=(x.dtype,))
    require(wkv.shape[1] == hidden and wkv.shape[0] % coff == 0 and wkv.shape[0] > 0, "wkv",
            f"[coff * D, H={hidden}] with coff={coff} (an nn.Linear weight: kv = x @ wkv.T)", wkv)
    dim = wkv.shape[0] // coff
    check_tensor("wgate", wgate, shape=tuple(wkv.shape), dtypes=(x.dtype,))
    check_tensor("ape", ape, shape=(ratio, coff * dim), dtypes=STATE_DTYPES)
    check_tensor("state_cache", state_cache, ndim=3, dtypes=STATE_DTYPES)
    require(state_cache.shape[2] == 2 * coff * dim and state_cache.shape[1] > 0, "state_cache",
            f"[blocks, block_size, 2 * coff * D = {2 * coff * dim}] ([kv | score] per position)", state_cache)
    if x.dim() == 3:
        require(cu_seqlens is None, "cu_seqlens", "None for x [B, S, H] (cu_seqlens is for packed x [T, H])",
                cu_seqlens)
    shape = output_shape(x, wkv, cu_seqlens, ratio, coff)
    _check_post(norm_weight, rope_sin, rope_cos, shape, dim, rope_head_dim, norm_eps, rotary_mode)
    return ratio, dim, shape


def check_device_metadata(x: Tensor, *, cu_seqlens, seqused, start_pos, state_block_table, cache_mode: int) -> None:
    """The metadata's shapes, dtypes and devices, without reading a value (the kernels read them, clamping every
    length into the tensors): the checks of a call whose metadata lives on the device."""
    if x.dim() == 2:
        check_index_vector("cu_seqlens", cu_seqlens, None, x.device)
        batch = cu_seqlens.shape[0] - 1
    else:
        batch = x.shape[0]
    check_index_vector("seqused", seqused, batch, x.device)
    check_index_vector("start_pos", start_pos, batch, x.device)
    if state_block_table is None:
        return
    if cache_mode == 2:
        check_index_vector("state_block_table", state_block_table, batch, x.device)
    else:
        check_tensor("state_block_table", state_block_table, ndim=2, dtypes=INDEX_DTYPES)
        require(state_block_table.shape[0] == batch, "state_block_table", f"[B={batch}, max_blocks]",
                state_block_table)


def compressor_problem(x: Tensor, wkv: Tensor, wgate: Tensor, state_cache: Tensor, ape: Tensor, *,
                       norm_weight, rope_sin, rope_cos, state_block_table, cu_seqlens, seqused, start_pos,
                       cmp_ratio: int, coff: int, cache_mode: int, rope_head_dim: int, norm_eps: float,
                       rotary_mode: int) -> CompressorProblem:
    """Validate a call (every argument, before any compute) and return its normal form."""
    ratio, dim, shape = check_operands(x, wkv, wgate, state_cache, ape, norm_weight=norm_weight, rope_sin=rope_sin,
                                       rope_cos=rope_cos, state_block_table=state_block_table, cu_seqlens=cu_seqlens,
                                       cmp_ratio=cmp_ratio, coff=coff, cache_mode=cache_mode,
                                       rope_head_dim=rope_head_dim, norm_eps=norm_eps, rotary_mode=rotary_mode)
    if x.dim() == 3:
        batch, s = x.shape[:2]
        starts, stored = [b * s for b in range(batch)], [s] * batch
    else:
        starts, stored = segments("cu_seqlens", cu_seqlens, x.shape[0])
        batch = len(starts)
    lens = used("seqused", seqused, stored)
    first = per_batch("start_pos", start_pos, batch, default=0)
    out_starts, row = [], 0
    for b in range(batch):
        out_starts.append(b * shape[1] if x.dim() == 3 else row)
        row += (first[b] + lens[b]) // ratio - first[b] // ratio
    batches = tuple(Batch(*v) for v in zip(starts, lens, first, out_starts))

    table = _state_table(state_block_table, state_cache, batches, ratio, coff, cache_mode)
    return CompressorProblem(batches, shape, ratio, coff, dim, cache_mode, table, state_cache.shape[1])


def _state_table(state_block_table: Tensor | None, state_cache: Tensor, batches: tuple[Batch, ...], ratio: int,
                 coff: int, cache_mode: int) -> Tensor | None:
    """The state block table as int64, after checking that every entry the call reads or writes is a cache block."""
    blocks, block_size = state_cache.shape[:2]
    if state_block_table is None:
        require(all(b.start_pos == 0 for b in batches), "state_block_table",
                "a state block table when a start_pos is > 0 (the earlier tokens live in the state)", None)
        return None
    if cache_mode == 2:
        check_tensor("state_block_table", state_block_table, shape=(len(batches),), dtypes=INDEX_DTYPES)
        require(block_size >= coff * ratio, "state_cache",
                f"a block_size >= coff * cmp_ratio = {coff * ratio} (ring buffer of cache_mode 2)", state_cache)
        entries = host_ints("state_block_table", state_block_table)
        require(all(0 <= e < blocks for e in entries), "state_block_table", f"entries in [0, {blocks})", entries)
        return state_block_table.to("cpu", torch.int64)
    check_tensor("state_block_table", state_block_table, ndim=2, dtypes=INDEX_DTYPES)
    require(state_block_table.shape[0] == len(batches), "state_block_table", f"[B={len(batches)}, max_blocks]",
            state_block_table)
    table = state_block_table.to("cpu", torch.int64)
    for b, batch in enumerate(batches):
        end = batch.start_pos + batch.n
        lo = max(0, (batch.start_pos // ratio - coff + 1) * ratio) if batch.emitted(ratio) else batch.start_pos
        if end <= lo:
            continue
        need = -(-end // block_size)
        require(table.shape[1] >= need, "state_block_table",
                f"at least {need} entries per batch (batch {b} uses positions up to {end - 1})", state_block_table)
        entries = host_ints("state_block_table", table[b, lo // block_size:need])
        require(all(0 <= e < blocks for e in entries), "state_block_table",
                f"entries in [0, {blocks}) for the blocks batch {b} reads or writes (0 = read-only)", entries)
    return table


def _check_post(norm_weight, rope_sin, rope_cos, shape: tuple[int, ...], dim: int, rope_head_dim: int,
                norm_eps: float, rotary_mode: int) -> None:
    """The optional RMSNorm and RoPE of the compressed rows (vllm-ascend's form)."""
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or not (
            math.isfinite(norm_eps) and norm_eps >= 0):
        fail("norm_eps", "a finite float >= 0", norm_eps)
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, shape=(dim,), dtypes=FLOAT_DTYPES)
    if (rope_sin is None) != (rope_cos is None):
        fail("rope_cos" if rope_cos is None else "rope_sin", "rope_sin and rope_cos together (or neither)", None)
    if rope_sin is not None:
        check_int("rope_head_dim", rope_head_dim, lo=2, hi=dim)
        require(rope_head_dim % 2 == 0, "rope_head_dim", f"an even int in [2, D={dim}]", rope_head_dim)
        check_choice("rotary_mode", rotary_mode, ROTARY_MODES)
        for name, t in (("rope_sin", rope_sin), ("rope_cos", rope_cos)):
            check_tensor(name, t, shape=(*shape[:-1], rope_head_dim), dtypes=FLOAT_DTYPES)
