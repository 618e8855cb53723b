"""The index tensors of one cached NSA step (new tokens continuing an :class:`NSACache`), looked up, not computed.

Everything a step needs besides the attention itself depends only on the positions of its new tokens, which live on
the device (``cache.lengths``): the page row each new key goes to, the compressed row each token may complete, the
window's key rows and mask, the compressed-attention masks. A step clamps its positions once (into the pages:
the true positions of every call the host allowed; a replay of a captured step past the pages then rewrites the
last row instead of writing out of bounds) and gathers each of these from tables indexed by position, a handful
of gathers instead of dozens of small arithmetic ops. The tables are built on the device from the cache's block
table (no upload, nothing read back), once per page allocation, and kept beside the cache
(:func:`_tables`: keyed by the identity and version of the block table they read); the position-only ones
(:func:`_position_table`, :func:`_mask_lookup`, :func:`_window_lookup`) are shared by every cache of the same sizes.
On CUDA the positions, the per-position lookups, RoPE of q and k and the compressed-attention masks are one Triton
launch (:func:`attnops.ops.nsa.step.prepare_decode_step`), with the same values as the ops here.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from .._core.staging import device_constant
from ..ops.nsa.layer import block_of
from ..ops.nsa.step import CompressedMasks, last_position, prepare_decode_step, step_lookups
from .nsa_cache import NSACache
from .rotary import apply_rotary, rotary_angles, rotary_table

POSITION, OWN_BLOCK = 0, 1  # the columns of _position_table


@dataclass(frozen=True)
class DecodeStep:
    """The lookups of one step of ``t`` tokens per sequence (``T = B * t``): ``positions [B, t]`` (clamped into the
    pages), ``slots [B, t]`` (flat page rows ``page * page_size + row`` of the new tokens), ``compressed_slots
    [T]`` (the row of the flattened compressed store each token's block fills once complete), ``ends [T]`` (each
    token's position + 1: the tokens up to it) and the per-cache ``tables``."""

    positions: Tensor
    slots: Tensor
    compressed_slots: Tensor
    ends: Tensor
    tables: "_Tables"
    window: int
    local_blocks: int
    masks_ready: bool = False  # the compressed-attention masks are in the tables' buffer (written by the kernel)


@dataclass(frozen=True)
class _Tables:
    """``slots [B, window - 1 + capacity]``: the flat page row of position ``x - (window - 1)`` (position 0's for
    the ``window - 1`` leading entries, which the window reads masked); ``compressed [B, capacity]``: the compressed
    row a token at each position fills (``b * rows + ``its block, clamped to the rows); ``masks``: the buffers the
    masks of a step are written into (:func:`_kept`)."""

    block_table: Tensor
    version: int | None
    slots: Tensor
    compressed: Tensor
    masks: dict = field(default_factory=dict)


_KEPT: "weakref.WeakKeyDictionary[NSACache, dict]" = weakref.WeakKeyDictionary()


def decode_step(cache: NSACache, q: Tensor, k: Tensor, *, window: int, local_blocks: int, theta: float
                ) -> tuple[DecodeStep, Tensor]:
    """The lookups of the next ``t`` tokens of ``cache`` (pages reserved for them first; nothing appended) and their
    queries ``q [T, N1, D]`` and keys ``k [T, N2, D]`` rotated at their positions, ``[T, N1 + N2, D]``: from the
    :func:`~attnops.nn.rotary.rotary_table` of the cache's capacity (on CUDA, one launch for all of it), or under
    ``torch.compile`` from angles computed at the positions (a traced graph keeps no table)."""
    t = q.shape[0] // cache.batch_size
    cache.reserve_for(t)
    tables = _tables(cache, window)
    lengths, offset = cache.lengths_on(q.device), max(window - 1, 0)
    ready = False
    if torch.compiler.is_compiling():
        positions, slots, compressed, ends = step_lookups(lengths, t, tables.slots, offset, tables.compressed)
        qk = torch.cat([q, k], -2)
        qk = apply_rotary(qk, *rotary_angles(positions.flatten(), q.shape[-1], theta, qk.dtype))
    else:
        rope = rotary_table(cache.capacity, q.shape[-1], theta, q.dtype, q.device)
        (positions, slots, compressed, ends, qk), ready = prepare_decode_step(
            lengths, t, tables.slots, offset, tables.compressed, rope, q, k,
            _masks_to_fill(cache, tables, t, local_blocks, q.device))
    return DecodeStep(positions, slots, compressed, ends, tables, window, local_blocks, ready), qk


def _masks_to_fill(cache: NSACache, tables: "_Tables", t: int, local_blocks: int, device: torch.device
                   ) -> CompressedMasks | None:
    """The compressed-attention masks of the step (:func:`compressed_masks`) for the step's kernel to write into the
    tables' buffer; None for a cache without selection blocks."""
    if cache.select_block_size is None:
        return None
    rows = cache.compressed_rows()
    n_sel = rows // (cache.select_block_size // cache.compress_stride)
    return CompressedMasks(_mask_buffer(tables, t, rows, n_sel, device)[0], rows, n_sel, cache.compress_block_size,
                           cache.compress_stride, cache.select_block_size, local_blocks)


def window_rows(step: DecodeStep) -> tuple[Tensor, Tensor]:
    """``(slots [B, span], mask [t, span])`` of the window branch (``span = window - 1 + t``): the flat page rows of
    the keys from ``window - 1`` before the first new token to the last one, and the mask (True = masked) of the
    keys outside each token's window or before position 0 (rows of strided views of the tables, picked by the first
    token's position: no arithmetic; the mask written into a buffer the tables keep, the same tensor at every
    step)."""
    t = step.positions.shape[1]
    span, slots = step.window - 1 + t, step.tables.slots
    before_start, band = _window_lookup(t, step.window, slots.shape[1], step.positions.device)
    first = step.positions[0, :1]
    if t > 1:  # the chunk's last keys lie within the pages when its first position is (a replay clamps them all)
        first = torch.minimum(first, last_position(slots.shape[1] - span + 1, first.device))
    mask = _kept(step.tables, ("window", t, span),
                 lambda: torch.empty(t, span, dtype=torch.bool, device=first.device))
    rows = slots.unfold(1, span, 1).index_select(1, first).flatten(1)
    if band is None:
        return rows, mask.copy_(before_start.unfold(0, span, 1).index_select(0, first))
    return rows, torch.bitwise_or(band, before_start.unfold(0, span, 1).index_select(0, first), out=mask)


def compressed_masks(step: DecodeStep, rows: int, n_sel: int, compress_block: int, compress_stride: int,
                     select_block: int) -> tuple[Tensor, Tensor]:
    """``(atten_mask [t, rows], topk_mask [t, n_sel])`` of the step's tokens (one set: the rows advance together):
    compressed row ``c`` is masked until complete (``c * stride + block - 1 > position``); the forced selection
    blocks are block 0 and the ``local_blocks`` blocks ending at the token's own (as
    :func:`~attnops.ops.nsa.compress_attention.forced_blocks`). One gather, one add and one lookup for both, or
    none when the step's kernel wrote them (on CUDA)."""
    t, device = step.positions.shape[1], step.positions.device
    masks, atten_mask, topk_mask = _mask_buffer(step.tables, t, rows, n_sel, device)
    if step.masks_ready:
        return atten_mask, topk_mask
    capacity = step.tables.compressed.shape[1]
    column, offset, lookup = _mask_lookup(capacity, rows, n_sel, compress_block, compress_stride, select_block,
                                          step.local_blocks, device)
    base = _position_table(capacity, select_block, device).index_select(0, step.positions[0])  # [t, 2]
    index = base.gather(1, column.expand(base.shape[0], -1))
    torch.take(lookup, index.add_(offset), out=masks)
    return atten_mask, topk_mask


def _mask_buffer(tables: "_Tables", t: int, rows: int, n_sel: int, device: torch.device
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """``(buffer [t, rows + n_sel], atten_mask, topk_mask)``: the cache's mask buffer for steps of ``t`` tokens and
    its two views, the same tensors at every step (a call configuration the operator has validated once)."""
    def make():
        buffer = torch.empty(t, rows + n_sel, dtype=torch.bool, device=device)
        return buffer, buffer[:, :rows], buffer[:, rows:]
    return _kept(tables, (t, rows, n_sel), make)


def _kept(tables: "_Tables", key: tuple, make: Callable[[], Any]) -> Any:
    """``make()`` once per ``key`` for ``tables``: mask buffers written at every step, the same tensors at every
    step, so that the operators reading them validate and plan their calls once."""
    kept = tables.masks
    if key not in kept:
        kept[key] = make()
    return kept[key]


def _tables(cache: NSACache, window: int) -> _Tables:
    """The cache's position tables for ``window``, rebuilt when its block table changes (another tensor, or the same
    one written: its version moves); built on every call under ``torch.compile`` (nothing kept in a traced graph)."""
    table = cache.block_table
    if torch.compiler.is_compiling():
        return _build_tables(cache, window, None)
    kept = _KEPT.setdefault(cache, {})
    tables, version = kept.get(window), _version(table)
    if tables is None or tables.block_table is not table or tables.version != version:
        tables = kept[window] = _build_tables(cache, window, version)
    return tables


def _build_tables(cache: NSACache, window: int, version: int | None) -> _Tables:
    table, page = cache.block_table, cache.page_size
    capacity, device = cache.capacity, table.device
    pos = torch.arange(capacity, device=device)
    flat = (table.long() * page).repeat_interleave(page, dim=1) + pos % page  # [B, capacity]
    padded = torch.cat([flat[:, :1].expand(-1, max(window - 1, 0)), flat], 1)
    rows = cache.compressed_rows()
    block = block_of((pos + 1 - cache.compress_block_size).clamp_min(0), cache.compress_stride).clamp_max(rows - 1)
    compressed = torch.arange(cache.batch_size, device=device)[:, None] * rows + block
    return _Tables(table, version, padded, compressed)


def _version(t: Tensor) -> int | None:
    """``t._version`` (None for an inference tensor, which has no version counter: the cache replaces its block
    table at every page allocation and never writes it, so its identity alone keys the tables then)."""
    return None if t.is_inference() else t._version


@device_constant(16)
def _position_table(capacity: int, select_block: int, device: torch.device) -> Tensor:
    """``[capacity, 2]`` int64: each position and its selection block (made once per size; read only)."""
    pos = torch.arange(capacity, device=device)
    return torch.stack([pos, block_of(pos, select_block)], 1)


@device_constant(32)
def _window_lookup(t: int, window: int, padded: int, device: torch.device) -> tuple[Tensor, Tensor | None]:
    """``(before_start, band)`` for ``t`` new tokens (``span = window - 1 + t``): ``before_start [padded]`` True
    where a padded coordinate ``x`` (position ``x - (window - 1)``) is before position 0, and the ``[t, span]`` mask
    of the keys outside each token's window (None for one token: its ``window`` keys are its window)."""
    j = torch.arange(window - 1 + t, device=device)
    i = torch.arange(t, device=device)[:, None]
    band = None if t == 1 else (j < i) | (j > i + window - 1)
    return torch.arange(padded, device=device) < window - 1, band


@device_constant(16)
def _mask_lookup(capacity: int, rows: int, n_sel: int, block: int, stride: int, select_block: int, local: int,
                 device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """``(column [1, rows + n_sel], offset [rows + n_sel], lookup)`` with ``lookup[base[column] + offset]`` the masks
    of :func:`compressed_masks` (``base``: a token's position and selection block).

    Compressed row ``c`` (columns ``[0, rows)``): ``y = position + end_last - end_c`` (``end_c = c * stride + block -
    1``), masked iff ``y < end_last``. Selection block ``c >= 1`` (columns after): ``z = own - c + n_sel - 1`` at
    ``lookup[forced + z]``, forced iff ``0 <= own - c < local``; block 0 at ``z = own + 2 * n_sel - 1``, always
    forced. Positions are below ``capacity`` and own blocks below ``n_sel``, so every index is in range."""
    c = torch.arange(rows, device=device)
    end_last = (rows - 1) * stride + block - 1
    forced = capacity + end_last  # past the largest compressed-row index
    s = torch.arange(n_sel, device=device)
    select_offset = torch.where(s == 0, forced + 2 * n_sel - 1, forced + n_sel - 1 - s)
    offset = torch.cat([end_last - (c * stride + block - 1), select_offset])
    column = torch.cat([torch.full((rows,), POSITION, device=device), torch.full((n_sel,), OWN_BLOCK, device=device)])
    y = torch.arange(forced + 3 * n_sel - 1, device=device)
    z = y - forced
    lookup = torch.where(y < forced, y < end_last, ((z >= n_sel - 1) & (z < n_sel - 1 + local)) | (z >= 2 * n_sel - 1))
    return column[None], offset, lookup
