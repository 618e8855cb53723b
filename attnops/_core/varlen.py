"""Sequence lengths: cumulative ``actual_seq_*`` lists, FA-style ``cu_seqlens``, ``seqused`` and per-batch offsets.

Internally every operator works on a :class:`SeqInfo`: per-batch lengths and start offsets of the query and
key/value tokens. Dense layouts are the special case of ``B`` equal lengths. Lengths given as flash-attn style
``cu_seqlens`` tensors on a GPU stay there (:class:`DeviceSeqLens`): the kernels read them, the host never does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .checks import Described, check_tensor, fail, int_list, require

INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class SeqInfo:
    """Per-batch query/KV lengths and token offsets (``q_starts[b]`` indexes the packed T axis)."""

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    q_starts: tuple[int, ...]
    kv_starts: tuple[int, ...]
    packed: bool  # True for TND (varlen), False for dense layouts

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def max_q(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def max_kv(self) -> int:
        return max(self.kv_lens, default=0)

    def score_numel(self, heads: int) -> int:
        """Number of score elements ``heads * sum_b Sq_b * Skv_b`` (the dropout mask length, torch_npu ``numels``)."""
        return heads * sum(a * b for a, b in zip(self.q_lens, self.kv_lens))

    def score_offsets(self, heads: int) -> list[int]:
        """Start of each batch's ``[heads, Sq_b, Skv_b]`` block in the flattened score order."""
        offs, acc = [], 0
        for a, b in zip(self.q_lens, self.kv_lens):
            offs.append(acc)
            acc += heads * a * b
        return offs

    @staticmethod
    def dense(batch: int, sq: int, skv: int) -> "SeqInfo":
        return SeqInfo((sq,) * batch, (skv,) * batch, tuple(b * sq for b in range(batch)),
                       tuple(b * skv for b in range(batch)), packed=False)


@dataclass(frozen=True, eq=False)
class DeviceSeqLens:
    """Varlen (TND) lengths as ``cu_seqlens`` tensors (int32/int64 ``[B + 1]``, leading 0) that only the kernels
    read. ``max_q``/``max_kv`` bound every length: ``max_seqlen_q/k`` when given (``bounds_given``), else the token
    counts, lowered to the rows/columns of a mask or pse the call reads. The kernels clamp each sequence to its
    packed tensor and to these bounds, so no length can address memory out of bounds; the values are not
    validated."""

    cu_q: torch.Tensor
    cu_kv: torch.Tensor
    max_q: int
    max_kv: int
    bounds_given: bool = False

    packed = True

    @property
    def batch(self) -> int:
        return self.cu_q.shape[0] - 1

    def bounded(self, rows: int | None = None, cols: int | None = None) -> "DeviceSeqLens":
        """These lengths, bounded by ``rows`` query and ``cols`` key/value tokens too (None: no bound)."""
        return DeviceSeqLens(self.cu_q, self.cu_kv, self.max_q if rows is None else min(self.max_q, rows),
                             self.max_kv if cols is None else min(self.max_kv, cols), self.bounds_given)


def device_seq_lens(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_kv: int,
                    max_seqlen_q: int | None, max_seqlen_k: int | None, device: torch.device) -> DeviceSeqLens:
    """Validate ``cu_seqlens`` tensors on ``device`` (shapes and dtypes only: their values stay on the device)."""
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        require(isinstance(t, torch.Tensor) and t.dtype in (torch.int32, torch.int64) and t.dim() == 1
                and t.shape[0] >= 1, name, "a 1-D int32/int64 tensor [B + 1] (leading 0)", t)
        require(t.device == device, name, f"a tensor on {device} like query (or a CPU tensor or list)", t)
    require(cu_seqlens_k.shape[0] == cu_seqlens_q.shape[0], "cu_seqlens_k",
            f"the same length as cu_seqlens_q ({cu_seqlens_q.shape[0]})", cu_seqlens_k)
    check_max_seqlen("max_seqlen_q", max_seqlen_q)
    check_max_seqlen("max_seqlen_k", max_seqlen_k)
    require((max_seqlen_q is None) == (max_seqlen_k is None), "max_seqlen_k", "max_seqlen_q and max_seqlen_k together",
            Described("only one of them"))
    if max_seqlen_q is None:
        return DeviceSeqLens(cu_seqlens_q, cu_seqlens_k, total_q, total_kv)
    return DeviceSeqLens(cu_seqlens_q, cu_seqlens_k, min(max_seqlen_q, total_q), min(max_seqlen_k, total_kv), True)


def check_max_seqlen(name: str, value, longest: int | None = None) -> None:
    """``max_seqlen_q/k``: None or an int >= 0, at least the longest host length (``longest``) when known."""
    if value is None:
        return
    require(isinstance(value, int) and not isinstance(value, bool) and value >= 0, name, "an int >= 0", value)
    if longest is not None:
        require(value >= longest, name, f"an int >= the longest sequence ({longest})", value)


def lengths_from_cumulative(name: str, cumulative, total: int | None = None) -> list[int]:
    """Per-batch lengths from a CANN cumulative list (no leading 0).

    A repeated value is an empty batch; zeros after the last non-zero value are empty (disabled) batches.
    ``total`` (the packed T) must be at least the last non-zero value.
    """
    values = int_list(name, cumulative)
    require(values is not None and len(values) > 0, name, "a non-empty cumulative list of ints", cumulative)
    last_nz = next((i for i in range(len(values) - 1, -1, -1) if values[i] != 0), -1)
    lens, prev = [], 0
    for i, v in enumerate(values):
        if i > last_nz:
            require(v == 0, name, "trailing entries after the last non-zero value to be 0", values)
            lens.append(0)
            continue
        if v < prev:
            fail(name, "a non-decreasing cumulative list (CANN actual_seq_* lists are prefix sums, "
                 "e.g. lengths [2,3,0] -> [2,5,5])", values)
        lens.append(v - prev)
        prev = v
    if total is not None:
        require(prev <= total, name, f"a last cumulative value <= the packed token count T={total}", values)
    return lens


def cumulative_from_cu_seqlens(name: str, cu_seqlens) -> list[int]:
    """Convert an FA-style ``cu_seqlens`` (leading 0, length B+1, non-decreasing) to the CANN cumulative list."""
    values = int_list(name, cu_seqlens)
    require(values is not None and len(values) >= 2 and values[0] == 0, name,
            "cu_seqlens with a leading 0 and length B+1", cu_seqlens if values is None else values)
    require(all(a <= b for a, b in zip(values, values[1:])), name,
            "non-decreasing offsets (sequence b is cu_seqlens[b]:cu_seqlens[b + 1])", values)
    return values[1:]


def cumulative_pair_from_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q: int | None,
                                    total_k: int | None) -> tuple[list[int], list[int]]:
    """:func:`cumulative_from_cu_seqlens` of ``cu_seqlens_q`` and ``cu_seqlens_k``, which must have one length and
    end within the packed token counts ``total_q`` / ``total_k`` (None: not known yet)."""
    q = cumulative_from_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    k = cumulative_from_cu_seqlens("cu_seqlens_k", cu_seqlens_k)
    require(len(k) == len(q), "cu_seqlens_k", f"the same length as cu_seqlens_q ({len(q) + 1})", [0, *k])
    for name, values, total in (("cu_seqlens_q", q, total_q), ("cu_seqlens_k", k, total_k)):
        require(total is None or values[-1] <= total, name, f"a last offset <= the packed token count T={total}",
                [0, *values])
    return q, k


def seq_info_varlen(q_lens: list[int], kv_lens: list[int]) -> SeqInfo:
    require(len(q_lens) == len(kv_lens), "actual_seq_kvlen", f"the same length as actual_seq_qlen ({len(q_lens)})",
            Described(f"length {len(kv_lens)}"))

    def starts(lens):
        out, acc = [], 0
        for n in lens:
            out.append(acc)
            acc += n
        return tuple(out)

    return SeqInfo(tuple(q_lens), tuple(kv_lens), starts(q_lens), starts(kv_lens), packed=True)


def as_cu_tensor(lens, device=None) -> torch.Tensor:
    """Per-batch lengths -> int32 cu_seqlens tensor with a leading 0 (for kernels)."""
    t = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
    if lens:
        t[1:] = torch.tensor(list(lens), dtype=torch.int64).cumsum(0).to(torch.int32)
    return t


def batch_windows(t: torch.Tensor, q_offsets, kv_offsets, seq: SeqInfo, fill) -> torch.Tensor:
    """Per-batch windows ``t[b or 0, :, q_off:q_off+Sq_b, kv_off:kv_off+Skv_b]`` of a ``[B|1, X, R, C]`` tensor, moved
    to the top-left of a new ``[B, X, max Sq, max Skv]`` tensor (the rest is ``fill``): left-padded batches read
    masks and pse at an offset."""
    out = torch.full((seq.batch, t.shape[1], max(seq.max_q, 1), max(seq.max_kv, 1)), fill, dtype=t.dtype,
                     device=t.device)
    for b, (qo, ko, sq, skv) in enumerate(zip(q_offsets, kv_offsets, seq.q_lens, seq.kv_lens)):
        out[b, :, :sq, :skv] = t[b if t.shape[0] > 1 else 0, :, qo:qo + sq, ko:ko + skv]
    return out


# Host per-batch lengths of the DeepSeek-V4 operators: ``cu_seqlens`` ([B+1], leading 0) of packed tensors,
# ``seqused`` ([B], the valid tokens of each batch, at most its stored length) and other per-batch int vectors.
def host_ints(name: str, t: Tensor, count: int | None = None) -> list[int]:
    """A 1-D int32/int64 tensor's values (``count`` of them when given) as Python ints."""
    require(t.device.type != "meta", name, "a tensor holding values (host metadata: on the CPU or the data's device)",
            t)
    check_tensor(name, t, ndim=1, dtypes=INDEX_DTYPES)
    if count is not None:
        require(t.shape[0] == count, name, f"{count} values (one per batch)", t)
    return [int(v) for v in t.tolist()]


def check_index_vector(name: str, t: Tensor | None, count: int | None, device: torch.device) -> None:
    """A metadata vector for the kernels on ``device`` (None passes): 1-D int32/int64 with ``count`` entries (at least
    one when ``count`` is None), on ``device`` or the CPU (uploaded later); its values are not read."""
    if t is None:
        return
    check_tensor(name, t, ndim=1, dtypes=INDEX_DTYPES)
    require(t.shape[0] == count if count is not None else t.shape[0] >= 1, name,
            f"{count} entries" if count is not None else "at least one entry", t)
    require(t.device == device or t.device.type == "cpu", name, f"a tensor on {device} like the data, or on the CPU",
            t)


def segments(name: str, cu_seqlens: Tensor | None, total: int) -> tuple[list[int], list[int]]:
    """``(starts, lengths)`` of the batches of a packed ``[T, ...]`` tensor from ``cu_seqlens`` ``[B+1]`` (leading 0,
    non-decreasing, last value at most ``total``)."""
    if cu_seqlens is None:
        fail(name, "cu_seqlens [B+1] (required with a packed [T, ...] layout)", None)
    cu = host_ints(name, cu_seqlens)
    require(len(cu) >= 2 and cu[0] == 0 and all(a <= b for a, b in zip(cu, cu[1:])), name,
            "a non-decreasing [B+1] prefix sum starting at 0", cu)
    require(cu[-1] <= total, name, f"a last value <= the packed token count T={total}", cu[-1])
    return cu[:-1], [b - a for a, b in zip(cu, cu[1:])]


def used(name: str, seqused: Tensor | None, lengths: list[int]) -> list[int]:
    """``seqused`` (``[B]``, each in ``[0, lengths[b]]``) when given, else ``lengths``."""
    if seqused is None:
        return list(lengths)
    values = host_ints(name, seqused, len(lengths))
    require(all(0 <= v <= n for v, n in zip(values, lengths)), name,
            f"per-batch counts in [0, stored length] (stored: {lengths})", values)
    return values


def per_batch(name: str, t: Tensor | None, batch: int, *, default: int, lo: int = 0, hi: int | None = None
              ) -> list[int]:
    """A per-batch int vector ``[B]`` with values in ``[lo, hi]``; ``default`` for every batch when None."""
    if t is None:
        return [default] * batch
    values = host_ints(name, t, batch)
    bound = "inf" if hi is None else hi
    require(all(v >= lo and (hi is None or v <= hi) for v in values), name, f"values in [{lo}, {bound}]", values)
    return values
