"""Inverted index lists for deterministic key gradients of sparse attention (NSA's selected attention, DSA's sparse
flash attention): every (query row, slot) pair that selected a key block is listed under that block, the lists in a
fixed order, and each list is cut into chunks that one program walks; the partials of a list cut into several chunks
are added in chunk order. Every key-gradient element then has one writer and a fixed summation order (no atomics).

Host side only (torch ops on the device, nothing read back): a kernel writes each pair's list id into ``keys`` (an id
``>= lists`` for a pair that selects nothing), :meth:`InvertedLists.schedule` orders them; the key-gradient kernels
find their list chunk with :func:`attnops.ops.common.triton.inverted_lists.list_chunk`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MIN_CHUNK_ROWS = 1024  # least (pair, query head) rows per key-gradient program on a GPU
MAX_CHUNK_ROWS = 1 << 30  # a program counts its rows in int32
CHUNK_PER_MEAN_LIST = 4  # the longest chunk as a multiple of the mean list (the partials' memory bound)
INTERPRET_LIST_CHUNK = 4  # entries per list chunk in the interpreter (so that small tests split lists)


def list_chunk(pairs: int, lists: int, group: int, interpret: bool) -> int:
    """Entries of an inverted list per key-gradient program (``group``: query heads per entry):
    ``CHUNK_PER_MEAN_LIST`` mean lists and at least ``MIN_CHUNK_ROWS`` rows on a GPU (at most ``MAX_CHUNK_ROWS``), so
    a long list runs on several programs while the partials of the split lists (at most ``2 * pairs // chunk``
    chunks) stay within half the size of the fp32 key gradient. At least 2 (:meth:`InvertedLists.schedule` counts an
    empty list's one chunk by truncating division)."""
    if interpret:
        return INTERPRET_LIST_CHUNK
    chunk = max(-(-MIN_CHUNK_ROWS // group), CHUNK_PER_MEAN_LIST * -(-pairs // max(lists, 1)))
    return max(2, min(chunk, MAX_CHUNK_ROWS // group))


@dataclass(frozen=True)
class InvertedLists:
    """Per list (a selectable key block), the pairs that selected it, and the schedule of the key-gradient programs.

    ``keys`` holds every pair's list id; :meth:`schedule` orders them (a stable sort: ``pair`` holds the sorted pair
    positions, in pair order within a list, so duplicates accumulate; ``token`` their int32 owners, the position
    divided by ``pairs_per_token``: NSA's query token, the pair itself for 1), finds the lists' bounds
    ``list_start [lists + 1]`` and cuts every list into chunks of ``chunk`` entries (at least one chunk per list):
    ``unit_end`` (inclusive cumulative chunk counts), ``unit_list`` (the list of each unit, ``lists`` past the last
    unit) and ``slot_end`` (inclusive cumulative partial slots: the chunk counts of the lists of several chunks).
    ``part_k``/``part_v`` hold those chunks' fp32 partial sums (``part_v`` None where the value gradient is part of
    the key's). ``units`` and ``slots`` bound the units and slots from the number of pairs alone (a list of
    ``k > 1`` chunks holds more than ``(k - 1) * chunk`` pairs). ``unit_end`` and ``slot_end`` are the rows of
    ``ends [2, lists]``, one ``cumsum`` of the rows of ``counts`` (every list's chunks, the split lists' chunks).
    Deterministic ops only (no ``bincount``), so ``torch.use_deterministic_algorithms(True)`` accepts them on CUDA;
    few and cheap ones, as the schedule runs at every backward call (truncating integer division, which on values
    from -1 up is the floor, except that -1 gives the 0 from which an empty list counts its one chunk)."""

    keys: torch.Tensor
    bounds: torch.Tensor
    sorted_keys: torch.Tensor
    pair: torch.Tensor
    token: torch.Tensor
    list_start: torch.Tensor
    unit_ids: torch.Tensor
    unit_end: torch.Tensor
    unit_list: torch.Tensor
    slot_end: torch.Tensor
    ends: torch.Tensor
    counts: torch.Tensor
    part_k: torch.Tensor | None
    part_v: torch.Tensor | None
    chunk: int
    pairs_per_token: int

    @staticmethod
    def allocate(keys: torch.Tensor, lists: int, chunk: int, part_rows: int, part_widths: tuple[int, ...],
                 pairs_per_token: int) -> "InvertedLists":
        """The buffers of ``keys`` (int64, one per pair) sorted into ``lists`` lists, partial slots of ``part_rows``
        rows of each width in ``part_widths`` (one or two: key, value)."""
        device, pairs = keys.device, keys.numel()
        units, slots = lists + pairs // chunk, max(1, 2 * (pairs // chunk))
        flat, pair = (torch.empty(pairs, dtype=torch.int64, device=device) for _ in range(2))
        empty = functools.partial(torch.empty, dtype=torch.int64, device=device)
        parts = [torch.empty((slots, part_rows, width), dtype=torch.float32, device=device) for width in part_widths]
        ends = empty((2, lists))
        return InvertedLists(keys, _list_ids(lists + 1, device), flat, pair,
                             torch.empty(pairs, dtype=torch.int32, device=device), empty(lists + 1),
                             _list_ids(units, device), ends[0], empty(units), ends[1], ends, empty((2, lists)),
                             parts[0], parts[1] if len(parts) > 1 else None, chunk, pairs_per_token)

    def schedule(self) -> None:
        """Order the keys the key kernel wrote and cut the lists into chunks (run between that launch and the key
        gradient's)."""
        torch.sort(self.keys.view(-1), stable=True, out=(self.sorted_keys, self.pair))
        torch.div(self.pair, self.pairs_per_token, rounding_mode="trunc", out=self.token)
        torch.searchsorted(self.sorted_keys, self.bounds, out=self.list_start)
        chunks, split = self.counts
        torch.sub(self.list_start[1:], self.list_start[:-1], out=chunks)
        chunks.sub_(1).div_(self.chunk, rounding_mode="trunc").add_(1)  # max(1, ceil(n / chunk))
        split.copy_(chunks)
        split.masked_fill_(chunks == 1, 0)
        torch.cumsum(self.counts, 1, out=self.ends)
        torch.searchsorted(self.unit_end, self.unit_ids, right=True, out=self.unit_list)


@functools.lru_cache(maxsize=64)
def _list_ids(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` on ``device``, made once per size (read only: the bounds the lists' starts are searched for, the
    units' ids)."""
    return torch.arange(n, device=device)
