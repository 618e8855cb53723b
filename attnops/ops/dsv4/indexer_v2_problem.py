"""Lightning indexer v2: argument validation and the call's normal form (flat query rows with their batch and key
limit, and the map from a batch's compressed key position to a flat key row).

Query ``[B, S1, N1, D]`` (``BSND``) or packed ``[T1, N1, D]`` (``TND``, ``cu_seqlens_q [B+1]``); compressed keys
``[B, S2, 1, D]`` / ``[T2, 1, D]`` (``cu_seqlens_k``) / a paged cache ``[blocks, block_size, 1, D]`` (``PA_BBND``,
ops-transformer's name, or ``PA_BSND``, vllm-ascend's,
with ``block_table [B, max_blocks]`` and the required ``seqused_k``). ``seqused_q`` / ``seqused_k`` override the
stored lengths. Mask mode 3: query row ``i`` of a batch with ``Lq`` rows and ``Lk`` compressed keys sits at the
uncompressed position ``p = Lk * cmp_ratio + residual - Lq + i`` and may use keys ``j < (p + 1) // cmp_ratio``
(capped at ``Lk``, none when negative); mode 0: all ``Lk`` keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..._core.checks import check_choice, check_int, check_same_device, check_tensor, require
from ..._core.varlen import INDEX_DTYPES, check_index_vector, host_ints, per_batch, segments, used

QUERY_LAYOUTS = ("BSND", "TND")
PAGED_LAYOUTS = ("PA_BBND", "PA_BSND")
KEY_LAYOUTS = ("BSND", "TND", *PAGED_LAYOUTS)
MASK_MODES = (0, 3)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TOPK_MAX = 8192


@dataclass(frozen=True)
class IndexerV2Problem:
    """``row_batch`` / ``row_limit`` (int64 ``[R]``: the batch of each flat query row and how many leading
    compressed keys it may use, 0 for padding rows), ``spans[b] = (first flat row, valid rows)``, and the key map:
    ``key_start[b] + j`` (contiguous keys) or ``block_table[b, j // block_size] * block_size + j % block_size``."""
    row_batch: Tensor
    row_limit: Tensor
    spans: tuple[tuple[int, int], ...]
    key_start: Tensor | None
    block_table: Tensor | None
    block_size: int

    def key_rows(self, batch: int, pos: Tensor) -> Tensor:
        """Flat key rows of batch ``batch``'s compressed positions ``pos`` (int64)."""
        if self.block_table is None:
            return self.key_start[batch] + pos
        return self.block_table[batch, pos // self.block_size] * self.block_size + pos % self.block_size


def key_limits(lq: int, lk: int, *, mask_mode: int, cmp_ratio: int, residual: int) -> Tensor:
    """How many leading compressed keys each of a batch's ``lq`` query rows may use (int64 ``[lq]``)."""
    if mask_mode == 0:
        return torch.full((lq,), lk, dtype=torch.int64)
    p = lk * cmp_ratio + residual - lq + torch.arange(lq)
    return torch.div(p + 1, cmp_ratio, rounding_mode="floor").clamp(0, lk)


def check_operands(query: Tensor, key: Tensor, weights: Tensor, *, topk: int, block_table, output_idx_offset,
                   layout_q: str, layout_k: str, mask_mode: int, cmp_ratio: int) -> int:
    """The checks that read no metadata value (layouts, attributes, the operands' and ``output_idx_offset``'s shapes,
    dtypes and devices); returns ``cmp_ratio``."""
    check_same_device("query", query, key=key, weights=weights, block_table=block_table,
                      output_idx_offset=output_idx_offset)
    check_choice("layout_q", layout_q, QUERY_LAYOUTS)
    check_choice("layout_k", layout_k, KEY_LAYOUTS)
    require(layout_k in (layout_q, *PAGED_LAYOUTS), "layout_k", f"{layout_q!r} like layout_q, or a paged layout",
            layout_k)
    check_choice("mask_mode", mask_mode, MASK_MODES)
    ratio = check_int("cmp_ratio", cmp_ratio, lo=1)
    check_int("topk", topk, lo=1, hi=TOPK_MAX)
    check_tensor("query", query, ndim=4 if layout_q == "BSND" else 3, dtypes=FLOAT_DTYPES)
    check_tensor("key", key, ndim=3 if layout_k == "TND" else 4, dtypes=(query.dtype,))
    require(key.shape[-2] == 1 and key.shape[-1] == query.shape[-1], "key",
            f"one key head of head dim D={query.shape[-1]} ([..., 1, {query.shape[-1]}])", key)
    check_tensor("weights", weights, shape=tuple(query.shape[:-1]),
                 dtypes=tuple(dict.fromkeys((torch.float32, torch.float64, query.dtype))))
    if output_idx_offset is not None:
        check_tensor("output_idx_offset", output_idx_offset, shape=(*query.shape[:-2], 1), dtypes=INDEX_DTYPES)
    return ratio


def check_device_metadata(query: Tensor, key: Tensor, *, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                          cmp_residual_k, block_table, layout_q: str, layout_k: str, mask_mode: int,
                          cmp_ratio: int) -> None:
    """The metadata's presence, shapes, dtypes and devices, without reading a value (the kernel reads them, clamping
    every length into the tensors): the checks of a call whose metadata lives on the device."""
    if layout_q == "BSND":
        require(cu_seqlens_q is None, "cu_seqlens_q", "None with layout_q 'BSND'", cu_seqlens_q)
        batch = query.shape[0]
    else:
        require(cu_seqlens_q is not None, "cu_seqlens_q", "cu_seqlens [B+1] (required with layout_q 'TND')", None)
        check_index_vector("cu_seqlens_q", cu_seqlens_q, None, query.device)
        batch = cu_seqlens_q.shape[0] - 1
    check_index_vector("seqused_q", seqused_q, batch, query.device)
    check_index_vector("seqused_k", seqused_k, batch, query.device)
    check_index_vector("cmp_residual_k", cmp_residual_k, batch, query.device)
    if layout_k in PAGED_LAYOUTS:
        require(cu_seqlens_k is None, "cu_seqlens_k", "None with a paged key", cu_seqlens_k)
        check_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES)
        require(block_table.shape[0] == batch, "block_table", f"[B={batch}, max_blocks]", block_table)
        require(seqused_k is not None, "seqused_k", "per-batch key counts [B] (required with a paged key)", None)
    else:
        require(block_table is None, "block_table", "None unless layout_k is paged ('PA_BBND')", block_table)
        if layout_k == "BSND":
            require(cu_seqlens_k is None, "cu_seqlens_k", "None with layout_k 'BSND'", cu_seqlens_k)
            require(key.shape[0] == batch, "key", f"batch B={batch} like query", key)
        else:
            require(cu_seqlens_k is not None, "cu_seqlens_k", "cu_seqlens [B+1] (required with layout_k 'TND')", None)
            check_index_vector("cu_seqlens_k", cu_seqlens_k, batch + 1, query.device)
    if mask_mode == 3 and cmp_ratio > 1:
        require(cmp_residual_k is not None, "cmp_residual_k",
                f"per-batch residuals [B] in [0, {cmp_ratio}) (required with mask_mode 3 and cmp_ratio > 1)", None)


def indexer_v2_problem(query: Tensor, key: Tensor, weights: Tensor, *, topk: int, cu_seqlens_q, cu_seqlens_k,
                       seqused_q, seqused_k, cmp_residual_k, block_table, output_idx_offset, layout_q: str,
                       layout_k: str, mask_mode: int, cmp_ratio: int) -> IndexerV2Problem:
    """Validate a call (every argument, before any compute) and return its normal form."""
    ratio = check_operands(query, key, weights, topk=topk, block_table=block_table,
                           output_idx_offset=output_idx_offset, layout_q=layout_q, layout_k=layout_k,
                           mask_mode=mask_mode, cmp_ratio=cmp_ratio)
    if layout_q == "BSND":
        require(cu_seqlens_q is None, "cu_seqlens_q", "None with layout_q 'BSND'", cu_seqlens_q)
        batch, s1 = query.shape[:2]
        q_starts, q_stored = [b * s1 for b in range(batch)], [s1] * batch
    else:
        q_starts, q_stored = segments("cu_seqlens_q", cu_seqlens_q, query.shape[0])
        batch = len(q_starts)
    q_lens = used("seqused_q", seqused_q, q_stored)

    table, block_size, k_start = None, 0, None
    if layout_k in PAGED_LAYOUTS:
        require(cu_seqlens_k is None, "cu_seqlens_k", "None with a paged key", cu_seqlens_k)
        check_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES)
        require(block_table.shape[0] == batch, "block_table", f"[B={batch}, max_blocks]", block_table)
        require(seqused_k is not None, "seqused_k", "per-batch key counts [B] (required with a paged key)", None)
        block_size = key.shape[1]
        k_lens = used("seqused_k", seqused_k, [block_table.shape[1] * block_size] * batch)
        table = block_table.to("cpu", torch.int64)
        _check_table(table, k_lens, block_size, key.shape[0])
    else:
        require(block_table is None, "block_table", "None unless layout_k is paged ('PA_BBND')", block_table)
        if layout_k == "BSND":
            require(cu_seqlens_k is None, "cu_seqlens_k", "None with layout_k 'BSND'", cu_seqlens_k)
            require(key.shape[0] == batch, "key", f"batch B={batch} like query", key)
            k_starts, k_stored = [b * key.shape[1] for b in range(batch)], [key.shape[1]] * batch
        else:
            k_starts, k_stored = segments("cu_seqlens_k", cu_seqlens_k, key.shape[0])
            require(len(k_starts) == batch, "cu_seqlens_k", f"B+1={batch + 1} values like cu_seqlens_q", cu_seqlens_k)
        k_lens = used("seqused_k", seqused_k, k_stored)
        k_start = torch.tensor(k_starts, dtype=torch.int64)

    residual = [0] * batch
    if mask_mode == 3 and ratio > 1:
        require(cmp_residual_k is not None, "cmp_residual_k",
                f"per-batch residuals [B] in [0, {ratio}) (required with mask_mode 3 and cmp_ratio > 1)", None)
        residual = per_batch("cmp_residual_k", cmp_residual_k, batch, default=0, hi=ratio - 1)
    elif cmp_residual_k is not None:
        residual = per_batch("cmp_residual_k", cmp_residual_k, batch, default=0, hi=ratio - 1)

    rows = query.shape[0] * query.shape[1] if layout_q == "BSND" else query.shape[0]
    row_batch = torch.zeros(rows, dtype=torch.int64)
    row_limit = torch.zeros(rows, dtype=torch.int64)
    for b, (start, lq) in enumerate(zip(q_starts, q_lens)):
        row_batch[start:start + lq] = b
        row_limit[start:start + lq] = key_limits(lq, k_lens[b], mask_mode=mask_mode, cmp_ratio=ratio,
                                                 residual=residual[b])
    return IndexerV2Problem(row_batch, row_limit, tuple(zip(q_starts, q_lens)), k_start, table, block_size)


def _check_table(table: Tensor, k_lens: list[int], block_size: int, blocks: int) -> None:
    """The block-table entries each batch's keys use are cache blocks ``[0, blocks)``."""
    for b, n in enumerate(k_lens):
        used_entries = host_ints("block_table", table[b, :-(-n // block_size)])
        require(all(0 <= e < blocks for e in used_entries), "block_table",
                f"entries in [0, {blocks}) for the {-(-n // block_size)} blocks batch {b}'s keys use",
                used_entries)
