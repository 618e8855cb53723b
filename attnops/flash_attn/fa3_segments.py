"""FlashAttention-3's ``seqused_q``/``seqused_k`` and ``attention_chunk`` as packed sequences the core knows.

Both only restrict which keys a query row sees, and both do it segment-wise, so each becomes a re-cut of the packed
sequences (new ``cu_seqlens``, the tokens stay where they are):

- ``seqused_q/k``: batch ``b`` uses the first ``seqused_q[b]`` query rows and ``seqused_k[b]`` keys of its segment;
  the rest form two more segments, unused rows with no key (output 0, no gradient) and unused keys with no row.
- ``attention_chunk = C``: with ``p = i + Sk - Sq`` (row ``i``'s bottom-right diagonal, used lengths), row ``i`` sees
  only keys in ``[p - p % C, p - p % C + C)``. The rows whose ``p`` falls in chunk ``c`` and the keys of chunk ``c``
  form one segment; its last row's diagonal is its last key, so the segment's own bottom-right ``causal`` /
  ``window_size`` equal the global ones. Rows with ``p < 0`` see no key.

Every batch gets the same number of segments (empty ones allowed), so the new ``cu_seqlens`` are computed on the
device without reading a length back.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.checks import check_tensor, require

__all__ = ["chunk_segments"]

_INTS = (torch.int32, torch.int64)


def _used(name: str, seqused, lens: Tensor) -> Tensor:
    """``seqused`` as int64 ``[B]`` (default: the whole segments), checked against the segment lengths on the CPU."""
    if seqused is None:
        return lens
    check_tensor(name, seqused, shape=(lens.shape[0],), dtypes=_INTS)
    require(seqused.device == lens.device, name, f"a tensor on {lens.device} (the device of the cu_seqlens)",
            seqused)
    used = seqused.long()
    if used.device.type == "cpu" and not torch.compiler.is_compiling():
        require(bool(((used >= 0) & (used <= lens)).all()), name,
                f"values in [0, the segment lengths {lens.tolist()}]", used.tolist())
    return used


def _packed(cu: Tensor, points: Tensor) -> Tensor:
    """int32 ``cu_seqlens`` of the segments whose starts within batch ``b`` are ``points[b]`` (``[B, P]``)."""
    return torch.cat([(cu[:-1].unsqueeze(1) + points).flatten(), cu[-1:]]).to(torch.int32)


def chunk_segments(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_q, seqused_k, attention_chunk: int,
                   max_seqlen_k: int) -> tuple[Tensor, Tensor]:
    """New ``(cu_seqlens_q, cu_seqlens_k)`` (int32 ``[B * (M + 3) + 1]``, ``M = ceil(max_seqlen_k / C)`` chunks,
    1 without ``attention_chunk``) that say ``seqused_q/k`` and ``attention_chunk`` with plain per-segment masks."""
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=_INTS)
    check_tensor("cu_seqlens_k", cu_seqlens_k, shape=tuple(cu_seqlens_q.shape), dtypes=_INTS)
    require(cu_seqlens_q.shape[0] >= 2 and cu_seqlens_k.device == cu_seqlens_q.device, "cu_seqlens_k",
            f"[B + 1] (B >= 1) offsets on {cu_seqlens_q.device} (those of cu_seqlens_q)", cu_seqlens_k)
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    u_q, u_k = _used("seqused_q", seqused_q, len_q), _used("seqused_k", seqused_k, len_k)
    chunk = attention_chunk if attention_chunk > 0 else max(max_seqlen_k, 1)
    starts = torch.arange(-(-max(max_seqlen_k, 1) // chunk), device=cu_q.device) * chunk  # [M] chunk starts
    shift = (u_k - u_q).unsqueeze(1)  # row i's diagonal is key i + shift
    # first row of each chunk (rows before chunk 0 see nothing); without chunks every used row is in chunk 0
    row_starts = (starts - shift).clamp(min=0) if attention_chunk > 0 else torch.zeros_like(shift)
    row_starts = torch.minimum(row_starts, u_q.unsqueeze(1))
    key_starts = torch.minimum(starts.expand(len_k.shape[0], -1), u_k.unsqueeze(1))
    zeros = torch.zeros_like(u_q).unsqueeze(1)
    # segments: rows before chunk 0 (no key), the chunks, unused rows (no key), unused keys (no row)
    q_points = torch.cat([zeros, row_starts, u_q.unsqueeze(1), len_q.unsqueeze(1)], 1)
    k_points = torch.cat([zeros, key_starts, u_k.unsqueeze(1), u_k.unsqueeze(1)], 1)
    return _packed(cu_q, q_points), _packed(cu_k, k_points)
