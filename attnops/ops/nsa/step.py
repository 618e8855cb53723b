"""The preparation of one cached NSA decoding step (``attnops.nn.NativeSparseAttention`` over an ``NSACache``): the
new tokens' positions from the sequences' device lengths, clamped into the pages, the per-position lookups (page
row, compressed row, KV length) and RoPE of the queries and keys from a ``[cos, signed sin]`` table. On CUDA one
Triton launch (:mod:`.triton.step`); elsewhere, under ``torch.compile`` or when the kernels cannot serve the call,
the eager ops below, with the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..._core.dispatch import choose_backend
from ..._core.staging import device_constant
from ..._core.triton.support import kernel_input_reason
from .triton import step_launch


@dataclass(frozen=True)
class CompressedMasks:
    """The compressed-attention masks a step's kernel writes, for the first sequence's tokens (the rows advance
    together), into ``out [t, rows + n_sel]`` (bool): ``atten_mask`` columns ``[0, rows)`` (compressed row ``c``
    masked until complete: ``c * stride + block - 1 > position``), ``topk_mask`` columns after (selection block
    ``s`` forced when it is block 0 or one of the ``local`` blocks ending at the token's own)."""

    out: Tensor
    rows: int
    n_sel: int
    block: int
    stride: int
    select_block: int
    local: int


def step_lookups(lengths: Tensor, t: int, slot_table: Tensor, slot_offset: int, compressed_table: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(positions [B, t], slots [B, t], compressed_slots [T], ends [T])`` of ``t`` new tokens per sequence
    (``lengths [B]`` int64 tokens so far): positions clamped to the last column of ``compressed_table [B,
    capacity]``, the page rows ``slot_table[b, slot_offset + position]``, the compressed rows
    ``compressed_table[b, position]`` and the KV lengths ``position + 1``."""
    capacity = compressed_table.shape[1]
    raw = lengths[:, None] if t == 1 else lengths[:, None] + _offsets(t, lengths.device)
    positions = torch.minimum(raw, last_position(capacity, lengths.device))
    return (positions, slot_table[:, slot_offset:].gather(1, positions),
            compressed_table.gather(1, positions).flatten(), _ends(capacity, lengths.device).take(positions.flatten()))


def prepare_decode_step(lengths: Tensor, t: int, slot_table: Tensor, slot_offset: int, compressed_table: Tensor,
                        rope_table: Tensor, q: Tensor, k: Tensor, masks: CompressedMasks | None = None
                        ) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor, Tensor], bool]:
    """``((*lookups, qk), masks_written)``: :func:`step_lookups` and ``qk [T, N1 + N2, D]``, ``q [T, N1, D]`` and
    ``k [T, N2, D]`` rotated by :func:`rotate_by_table` with the rows of ``rope_table [capacity, 2, D]`` at the
    positions; on CUDA in one Triton launch, which also fills ``masks`` (``masks_written``: the caller computes them
    otherwise)."""
    if not torch.compiler.is_compiling() and choose_backend(
            "auto", q.device, lambda: kernel_input_reason(q, "activations")) == "triton":
        return step_launch.decode_step(lengths, t, slot_table, slot_offset, compressed_table, rope_table, q, k,
                                       masks), masks is not None
    positions, slots, compressed, ends = step_lookups(lengths, t, slot_table, slot_offset, compressed_table)
    qk = rotate_by_table(torch.cat([q, k], -2), rope_table.index_select(0, positions.flatten()))
    return (positions, slots, compressed, ends, qk), False


def rotate_by_table(x: Tensor, rows: Tensor) -> Tensor:
    """Rotate-half RoPE of ``x [T, N, D]`` with ``rows [T, 2, D]`` (``[cos, sin]``, the sine's first half negated):
    ``x`` and its halves swapped (one gather) times the cosine and the signed sine (one product, each rounded as
    ``rotate_half``'s, whose ``cat([-x2, x1]) * sin`` is the swapped halves times the signed sine), then their sum
    over the pair (one reduction: the same sum of two rounded products)."""
    pairs = x.unflatten(-1, (2, -1)).index_select(-2, _swap_order(x.device)).unflatten(-2, (2, 2)).flatten(-2)
    return (pairs * rows.unsqueeze(1)).sum(-2)


@device_constant(8)
def _swap_order(device: torch.device) -> Tensor:
    """``[0, 1, 1, 0]``: the halves of ``x`` then of ``x`` swapped (made once per device; read only)."""
    return (torch.arange(1, 5, device=device) // 2) % 2


@device_constant(16)
def _offsets(t: int, device: torch.device) -> Tensor:
    """``[1, t]`` int64 ``arange(t)`` (made once per size; read only)."""
    return torch.arange(t, device=device)[None]


@device_constant(16)
def last_position(capacity: int, device: torch.device) -> Tensor:
    """0-dim int64 ``capacity - 1`` on ``device`` (made once per size; read only)."""
    return torch.full((), capacity - 1, dtype=torch.int64, device=device)


@device_constant(16)
def _ends(capacity: int, device: torch.device) -> Tensor:
    """``[capacity]`` int64: position + 1 (made once per size; read only)."""
    return torch.arange(1, capacity + 1, device=device)
