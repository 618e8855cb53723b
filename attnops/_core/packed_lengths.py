"""Per-batch lengths of the DeepSeek-V4 operators: flash-attn style ``cu_seqlens`` (``[B+1]``, leading 0) for packed
tensors, ``seqused`` (``[B]``, the valid tokens of each batch, at most its stored length) and other per-batch int
vectors. Host metadata: read once per call."""
from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_tensor, fail, require

INDEX_DTYPES = (torch.int32, torch.int64)


def host_ints(name: str, t: Tensor, count: int | None = None) -> list[int]:
    """A 1-D int32/int64 tensor's values (``count`` of them when given) as Python ints."""
    check_tensor(name, t, ndim=1, dtypes=INDEX_DTYPES)
    require(t.device.type != "meta", name, "a tensor holding values (host metadata: on the CPU or the data's device)",
            t)
    if count is not None:
        require(t.shape[0] == count, name, f"{count} values (one per batch)", t)
    return [int(v) for v in t.tolist()]


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
