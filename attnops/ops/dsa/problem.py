"""The DSA ops' normal form: query rows flattened to ``[R, N1, D]`` with per-row batch, position and key limit, and
the key side flattened to ``[M, D]`` with a map from (batch, logical position) to a flat row.

Layouts (query: ``BSND`` / ``TND``; key: ``BSND`` / ``TND`` / ``PA_BSND``) and the lengths that come with them are
read here, once, for every DSA op: ``BSND`` lengths are per batch (a length-1 tensor applies to every batch, None
means every row is valid), ``TND`` lengths are cumulative without a leading 0 and required, paged keys take
per-batch lengths (required) and a ``block_table [B, max_blocks]``. Causal rule (``sparse_mode`` 3): query row ``i``
of a batch with ``Lq`` query and ``Lk`` key rows may use key positions ``j < Lk - Lq + i + 1``; mode 0: ``j < Lk``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ..._core.checks import check_choice, check_tensor, fail, require
from ..._core.indices import valid_ids

QUERY_LAYOUTS = ("BSND", "TND")
KEY_LAYOUTS = ("BSND", "TND", "PA_BSND")
SPARSE_MODES = (0, 3)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Rows:
    """Per flat query row: its batch, position within the batch, whether it is a real row, the number of key
    positions it may use (``limit``: 0 for padding rows) and its batch's key length."""
    batch: Tensor
    pos: Tensor
    valid: Tensor
    limit: Tensor
    key_len: Tensor


@dataclass(frozen=True)
class KeyAddress:
    """Where logical key position ``j`` of batch ``b`` sits in the flat ``[M, D]`` key store: ``start[b] + j``
    (contiguous layouts) or through the block table (paged: int64 on the CPU, or a device table the kernels read,
    see :mod:`.call`) of a cache of ``blocks`` blocks."""
    start: Tensor | None
    block_table: Tensor | None
    block_size: int
    blocks: int = 0

    def _block_ids(self, batch: Tensor, pos: Tensor) -> Tensor:
        return self.block_table[batch, (pos.clamp_min(0) // self.block_size).clamp_max(self.block_table.shape[1] - 1)]

    def flat(self, batch: Tensor, pos: Tensor) -> Tensor:
        """Flat key rows of ``pos`` (int64, any shape broadcasting with ``batch``); negative positions and positions
        in a block outside the cache map to row 0 (callers mask them, see :meth:`addressable`)."""
        pos = pos.clamp_min(0)
        if self.block_table is None:
            return self.start[batch] + pos
        blocks = self._block_ids(batch, pos).clamp(0, max(self.blocks - 1, 0))
        return blocks * self.block_size + pos % self.block_size

    def addressable(self, batch: Tensor, pos: Tensor) -> Tensor | None:
        """Whether the blocks of ``pos`` are in the cache (bool; None for contiguous keys, always addressable): an
        unvalidated block id outside it contributes no keys."""
        if self.block_table is None:
            return None
        return valid_ids(self._block_ids(batch, pos), self.blocks)


@dataclass(frozen=True)
class Problem:
    """A DSA call in normal form: ``keys`` (key side), each batch's query rows ``spans[b] = (first flat row, count)``
    out of ``total_rows`` flat rows, the batch count, the layouts, the sparse mode and each batch's key length.
    ``rows`` (the per-row metadata the CPU references read) is built on first use: the Triton kernels derive it from
    the lengths themselves, so a call on them never pays for it."""
    keys: KeyAddress
    spans: tuple[tuple[int, int], ...]
    batch: int
    layout_query: str
    layout_key: str
    sparse_mode: int
    key_lens: tuple[int, ...]
    total_rows: int

    @functools.cached_property
    def rows(self) -> Rows:
        return _rows(self.total_rows, self.spans, self.key_lens, self.sparse_mode)


def _int_values(name: str, t: Tensor) -> list[int]:
    """A 1-D int tensor's values as Python ints (a host read: lengths are host metadata)."""
    check_tensor(name, t, ndim=1, dtypes=INDEX_DTYPES)
    return [int(v) for v in t.tolist()]


def _from_cumulative(name: str, t) -> tuple[list[int], list[int]]:
    """(starts, lengths) from cumulative sums without a leading 0 (required, non-decreasing)."""
    if t is None:
        fail(name, "cumulative lengths (required with layout TND)", None)
    ends = _int_values(name, t)
    require(len(ends) >= 1 and all(e >= 0 for e in ends) and all(a <= b for a, b in zip(ends, ends[1:])), name,
            "non-empty, non-decreasing cumulative lengths without a leading 0", ends)
    starts = [0, *ends[:-1]]
    return starts, [e - s for s, e in zip(starts, ends)]


def _per_batch(name: str, t, batch: int, rows: int, *, required: bool) -> list[int]:
    """Per-batch lengths (a single value applies to every batch; None: ``rows`` each unless required)."""
    if t is None:
        if required:
            fail(name, "per-batch lengths (required with a paged key)", None)
        return [rows] * batch
    lens = _int_values(name, t)
    if len(lens) == 1:
        lens = lens * batch
    require(len(lens) == batch and all(0 <= n <= rows for n in lens), name,
            f"{batch} per-batch lengths (or one for every batch) in [0, {rows}]", lens)
    return lens


def check_layouts(layout_query: str, layout_key: str) -> None:
    check_choice("layout_query", layout_query, QUERY_LAYOUTS)
    check_choice("layout_key", layout_key, KEY_LAYOUTS)
    if layout_key != "PA_BSND":
        require(layout_key == layout_query, "layout_key", f"{layout_query!r} like layout_query (or 'PA_BSND')",
                layout_key)


def flat_query(x: Tensor, layout: str) -> Tensor:
    """``[B, S, N, D]`` / ``[T, N, D]`` -> ``[R, N, D]`` (a view)."""
    return x.flatten(0, 1) if layout == "BSND" else x


def flat_key(x: Tensor) -> Tensor:
    """A key-side tensor with one kv head (``[B, S, 1, D]``, ``[T, 1, D]``, ``[blocks, block_size, 1, D]``) ->
    ``[M, D]``."""
    return x.reshape(-1, x.shape[-1])


def check_operands(query: Tensor, key: Tensor, *, layout_query: str, layout_key: str, sparse_mode: int,
                   key_name: str = "key") -> None:
    """The layouts, the sparse mode and the ranks of ``query`` and the one-kv-head ``key``."""
    check_layouts(layout_query, layout_key)
    check_choice("sparse_mode", sparse_mode, SPARSE_MODES)
    check_tensor("query", query, ndim=4 if layout_query == "BSND" else 3)
    check_tensor(key_name, key, ndim=3 if layout_key == "TND" else 4)
    require(key.shape[-2] == 1, key_name, "one key/value head (N2 = 1)", key)


def build_problem(query: Tensor, key: Tensor, *, layout_query: str, layout_key: str, sparse_mode: int,
                  actual_seq_lengths_query=None, actual_seq_lengths_key=None, block_table: Tensor | None = None,
                  key_name: str = "key", key_lengths_name: str = "actual_seq_lengths_key") -> Problem:
    """The normal form of a call with ``query`` ``[B, S1, N1, D]`` / ``[T1, N1, D]`` and one-kv-head ``key``
    (lengths read and validated on the host; a block table on a device is kept there, unread)."""
    check_operands(query, key, layout_query=layout_query, layout_key=layout_key, sparse_mode=sparse_mode,
                   key_name=key_name)
    if layout_query == "BSND":
        batch, s1 = query.shape[0], query.shape[1]
        q_lens = _per_batch("actual_seq_lengths_query", actual_seq_lengths_query, batch, s1, required=False)
        q_starts = [b * s1 for b in range(batch)]
    else:
        q_starts, q_lens = _from_cumulative("actual_seq_lengths_query", actual_seq_lengths_query)
        batch = len(q_lens)
        require(q_starts[-1] + q_lens[-1] <= query.shape[0], "actual_seq_lengths_query",
                f"a last cumulative length <= query's T1 ({query.shape[0]})", q_starts[-1] + q_lens[-1])
    table = None
    if layout_key == "PA_BSND":
        check_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES)
        require(block_table.shape[0] == batch, "block_table", f"[B={batch}, max_blocks]", block_table)
        block_size = key.shape[1]
        k_lens = _per_batch(key_lengths_name, actual_seq_lengths_key, batch, block_table.shape[1] * block_size,
                            required=True)
        on_host = block_table.device.type == "cpu"
        table = block_table.to(torch.int64) if on_host else block_table  # a device table: the kernels read it
        k_starts = [0] * batch
    elif layout_key == "BSND":
        require(key.shape[0] == batch, key_name, f"batch B={batch} like query", key)
        block_size = 0
        k_lens = _per_batch(key_lengths_name, actual_seq_lengths_key, batch, key.shape[1], required=False)
        k_starts = [b * key.shape[1] for b in range(batch)]
    else:
        block_size = 0
        k_starts, k_lens = _from_cumulative(key_lengths_name, actual_seq_lengths_key)
        require(len(k_lens) == batch, key_lengths_name, f"{batch} cumulative lengths like the query's", k_lens)
        require(k_starts[-1] + k_lens[-1] <= key.shape[0], key_lengths_name,
                f"a last cumulative length <= {key_name}'s T2 ({key.shape[0]})", k_starts[-1] + k_lens[-1])
    keys = KeyAddress(None if table is not None else torch.tensor(k_starts, dtype=torch.int64), table, block_size,
                      key.shape[0] if table is not None else 0)
    return Problem(keys, tuple(zip(q_starts, q_lens)), batch, layout_query, layout_key, sparse_mode, tuple(k_lens),
                   query.shape[0] * query.shape[1] if layout_query == "BSND" else query.shape[0])


def _rows(total: int, spans: tuple[tuple[int, int], ...], k_lens: tuple[int, ...], sparse_mode: int) -> Rows:
    """The :class:`Rows` of ``total`` flat rows, batch ``b`` holding rows ``spans[b]`` (slice writes per batch, no
    gather over the rows); padding rows: batch 0, position 0, limit and key length 0."""
    batch, pos, limit, key_len = (torch.zeros(total, dtype=torch.int64) for _ in range(4))
    valid = torch.zeros(total, dtype=torch.bool)
    for b, ((s, n), k) in enumerate(zip(spans, k_lens)):
        batch[s:s + n] = b
        pos[s:s + n] = torch.arange(n)
        valid[s:s + n] = True
        key_len[s:s + n] = k
        limit[s:s + n] = k if sparse_mode == 0 else torch.arange(k - n + 1, k + 1).clamp_min(0)
    return Rows(batch, pos, valid, limit, key_len)


def row_chunks(problem: Problem, bytes_per_row: int, budget: int = 1 << 26):
    """``(batch, lo, hi)``: flat query row ranges within one batch, of at most ``budget`` bytes of work tensors
    each (at least one row); padding rows are skipped."""
    step = max(1, budget // max(1, bytes_per_row))
    for b, (start, count) in enumerate(problem.spans):
        for lo in range(start, start + count, step):
            yield b, lo, min(start + count, lo + step)


def compute_dtype(x: Tensor) -> torch.dtype:
    """fp64 inputs compute in fp64 (goldens, gradcheck), everything else in fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
