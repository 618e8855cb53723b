"""Validation of index values: block tables, index rows (sparse / top-k / block indices), slot mappings and the
room in output buffers, shared by every operator that reads or writes keys through indices.

Whether values are checked is :func:`validation_enabled`'s answer: the environment variable ``ATTNOPS_VALIDATE``
(``1``: on every device, ``0``: never), by default on the CPU only (on a GPU a check reads the values back to the
host, which the hot path never does). Each check is one vectorized pass over the index tensor; an error names the
offending entry, what was expected and what was received.

With validation off an invalid value is masked out, on every path alike: a block id outside the cache contributes
no keys, an index outside ``[0, key length)`` (or a negative one other than the ``-1`` padding) selects no key, and
a slot outside the cache writes nothing. :func:`valid_ids` is that rule for the CPU paths.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from .checks import Described, fail, require

ENV_VAR = "ATTNOPS_VALIDATE"
PAD = -1  # the documented padding of index rows, block tables and slot mappings


def validation_enabled(device: torch.device | str) -> bool:
    """Whether index values on ``device`` are validated: ``ATTNOPS_VALIDATE`` ``1`` / ``0`` decides, unset means on
    the CPU only."""
    value = os.environ.get(ENV_VAR, "").strip()
    if value in ("0", "1"):
        return value == "1"
    require(not value, ENV_VAR, "'1' (validate on every device), '0' (never) or unset (on the CPU only)", value)
    return torch.device(device).type == "cpu"


def valid_ids(ids: Tensor, count: int) -> Tensor:
    """``0 <= ids < count`` (bool, ids' shape): the entries that address something; the others are masked out."""
    return (ids >= 0) & (ids < count)


def all_valid_ids(ids: Tensor, count: int) -> bool:
    """Whether every entry of ``ids`` addresses something (:func:`valid_ids` everywhere), in one pass."""
    if ids.numel() == 0:
        return True
    lo, hi = torch.aminmax(ids)
    return int(lo) >= 0 and int(hi) < count


def _first(bad: Tensor) -> tuple[int, ...] | None:
    """The index of the first True entry of ``bad`` (C order), or None."""
    if not bool(bad.any()):
        return None
    return tuple(int(i) for i in bad.nonzero()[0])


def _bad_entry(name: str, where: tuple[int, ...], value: int, expected: str, context: str = "") -> None:
    """Raise the error of entry ``name[where] = value`` (``context``: why the entry is read)."""
    fail(name, expected, Described(f"{name}[{', '.join(map(str, where))}] = {value}{context}"))


def blocks_needed(lengths: Tensor, block_size: int) -> Tensor:
    """Per sequence, the blocks its ``lengths`` tokens occupy (int64)."""
    return (lengths.to(torch.int64) + block_size - 1) // block_size


def check_block_table(table: Tensor, lengths, block_size: int, num_blocks: int, *, name: str = "block_table",
                      lengths_name: str = "actual_seq_lengths", first: Tensor | None = None) -> None:
    """Every entry that batch ``b``'s ``lengths[b]`` tokens use (``table[b, first[b] + i]`` for ``i < ceil(lengths[b]
    / block_size)``, ``first`` 0 by default) is a block id in ``[0, num_blocks)``; the other entries are never read
    (``-1`` or anything)."""
    table = table.detach().to("cpu", torch.int64)
    lengths = torch.as_tensor(lengths, dtype=torch.int64).cpu().reshape(-1)
    need = blocks_needed(lengths, block_size)
    first = torch.zeros_like(need) if first is None else first.to("cpu", torch.int64)
    short = _first(first + need > table.shape[1])
    if short is not None:
        b = short[0]
        fail(name, f"at least {int(first[b] + need[b])} columns: batch {b} has {int(lengths[b])} tokens "
                   f"({lengths_name}), which need {int(need[b])} blocks of {block_size} from column {int(first[b])}",
             table)
    column = torch.arange(table.shape[1])
    used = (column >= first[:, None]) & (column < (first + need)[:, None])
    bad = _first(used & ~valid_ids(table, num_blocks))
    if bad is not None:
        b = bad[0]
        _bad_entry(name, bad, int(table[bad]), f"a block id in [0, {num_blocks}) (the cache's blocks)",
                   f", but batch {b} has {int(lengths[b])} tokens ({lengths_name}), which need {int(need[b])} blocks "
                   f"of {block_size}" + (f" from column {int(first[b])}" if int(first[b]) else ""))


def entries_read(indices: Tensor, count: Tensor) -> Tensor:
    """The entries of each index row (last dim) an operator reads (bool, indices' shape): its first ``count`` (one
    per row, broadcasting with ``indices.shape[:-1]``), up to the first ``-1`` (padding ends a row)."""
    width = indices.shape[-1]
    pad = indices == PAD
    first_pad = torch.where(pad.any(-1), pad.to(torch.uint8).argmax(-1), width)
    return torch.arange(width) < torch.minimum(count.to(torch.int64), first_pad)[..., None]


def check_index_rows(name: str, indices: Tensor, read: Tensor, bound: Tensor, *, unit: int = 1,
                     what: str = "the batch's key length", padding: bool = True) -> None:
    """Each entry ``v`` that is ``read`` covers positions ``v * unit ..`` and must satisfy ``0 <= v * unit <
    bound`` (``bound`` one per row, broadcasting with ``indices.shape[:-1]``; ``padding``: whether the operator
    takes ``-1`` as padding, for the message)."""
    idx = indices.detach().to("cpu", torch.int64)
    bound = bound.to(torch.int64).expand(idx.shape[:-1])
    bad = _first(read & ((idx < 0) | (idx * unit >= bound[..., None])))
    if bad is not None:
        limit = -(-int(bound[bad[:-1]]) // unit)
        _bad_entry(name, bad, int(idx[bad]), f"an index in [0, {limit}) ({what}: {int(bound[bad[:-1]])}"
                   f"{'' if unit == 1 else f' positions in blocks of {unit}'})"
                   + (f" or {PAD} (padding)" if padding else ""))


def check_slots(name: str, slots: Tensor, capacity: int, *, what: str) -> None:
    """Every slot is ``-1`` (skipped) or in ``[0, capacity)`` (``what``: the cache the slots address)."""
    flat = slots.detach().to("cpu", torch.int64)
    bad = _first((flat != PAD) & ~valid_ids(flat, capacity))
    if bad is not None:
        _bad_entry(name, bad, int(flat[bad]), f"a slot in [0, {capacity}) ({what}) or {PAD} (skipped)")


def check_room(name: str, out: Tensor, dim: int, needed: int, what: str) -> None:
    """``out`` holds at least ``needed`` entries along ``dim`` (``what``: where the number comes from)."""
    require(out.shape[dim] >= needed, name, f"at least {needed} rows along dim {dim} ({what})", out)
