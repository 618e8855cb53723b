"""Position shift (pse): external tensors (pse_type 0/1), flattened TND tensors, ALiBi-compressed tensors and in-kernel
ALiBi slopes (pse_type 2/3), as one :class:`PseSpec` that yields fp32 tiles and accumulates tile gradients (dpse).

Score formulas (``cann_semantics.md`` §2): type 1 ``scale*(QK^T + pse)``; types 0/2/3 ``scale*QK^T + pse``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import Described, check_tensor, fail, int_list, require
from .masks import MaskRule, MaskSpec
from .varlen import DeviceSeqLens, SeqInfo

ALIBI_ROWS = 1024
PSE_TYPES = (0, 1, 2, 3)


@dataclass(frozen=True)
class PseSpec:
    """One pse source. ``kind``: ``full`` [Bp,N,R,C], ``row`` [Bp,N,1,C], ``alibi`` [Bp,N,1024,W], ``slopes``.

    A flattened TND pse (1-D) is ``full`` or ``row`` with ``segments``: batch b's ``(offset, N1, rows, cols)`` block
    of the 1-D tensor, read as ``[N1, rows, cols]`` (rows = Sq_b for ``full``, 1 for ``row``).
    ``slopes`` (pse_type 2/3) start counting positions at ``start_idx`` (q, kv) in every batch, or in batch 0 alone
    with ``first_batch_only`` (varlen sparse_mode 8); with ``bottom_right`` query positions start at
    ``Skv_b - Sq_b + q_start`` (flash-attn's alignment, any Sq and Skv); ``q_start``/``kv_start`` hold the per-batch
    starts for host
    lengths (the prepare kernel derives them for device lengths).
    """

    pse_type: int
    kind: str
    tensor: torch.Tensor
    q_start: tuple[int, ...] = ()
    kv_start: tuple[int, ...] = ()
    segments: tuple[tuple[int, int, int, int], ...] = ()
    start_idx: tuple[int, int] = (0, 0)
    first_batch_only: bool = False
    bottom_right: bool = False  # slopes: query positions start at Skv - Sq + q_start in each batch (flash-attn)

    @property
    def flattened(self) -> bool:
        return bool(self.segments)

    @property
    def add_before_scale(self) -> bool:
        return self.pse_type == 1

    @property
    def has_grad(self) -> bool:
        return self.kind != "slopes"

    def _batch_view(self, t: torch.Tensor, b: int) -> torch.Tensor:
        """Batch b's ``[N, R, C]`` view of ``t`` (the pse or its gradient, same shape)."""
        if self.segments:
            off, heads, rows, cols = self.segments[b]
            return t[off:off + heads * rows * cols].view(heads, rows, cols)
        return t[b if t.shape[0] > 1 else 0]

    def padded(self) -> torch.Tensor:
        """A flattened pse as the zero-padded 4-D ``[B, N1, max rows, max Skv]`` tensor of its segments."""
        heads = self.segments[0][1]
        rows = max(r for _, _, r, _ in self.segments)
        cols = max(c for _, _, _, c in self.segments)
        out = self.tensor.new_zeros((len(self.segments), heads, rows, cols))
        for b, (_, _, r, c) in enumerate(self.segments):
            out[b, :, :r, :c] = self._batch_view(self.tensor, b)
        return out

    def flatten_grad(self, padded: torch.Tensor) -> torch.Tensor:
        """The 1-D gradient of a flattened pse from its padded ``[B, N1, max rows, max Skv]`` form."""
        return torch.cat([padded[b, :, :r, :c].reshape(-1) for b, (_, _, r, c) in enumerate(self.segments)])

    def _alibi_index(self, r0, r1, c0, c1) -> torch.Tensor:
        w = self.tensor.shape[-1]
        diag = torch.arange(r0, r1).unsqueeze(1) - torch.arange(c0, c1).unsqueeze(0)
        return (w - 1 - diag).clamp(0, w - 1)

    def block(self, b: int, r0: int, r1: int, c0: int, c1: int, heads: slice,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """pse tile ``[Nh, r1-r0, c1-c0]`` (or broadcastable) in ``dtype`` for batch ``b`` and query ``heads``."""
        t = self.tensor
        if self.kind == "slopes":
            slope = (t[b] if t.dim() == 2 else t)[heads].to(dtype)
            dist = ((torch.arange(c0, c1) + self.kv_start[b]).unsqueeze(0)
                    - (torch.arange(r0, r1) + self.q_start[b]).unsqueeze(1)).abs().to(dtype)
            if self.pse_type == 3:
                dist = dist.sqrt()
            return -slope.view(-1, 1, 1) * dist
        tb = self._batch_view(t, b)[heads]
        if self.kind == "full":
            return tb[:, r0:r1, c0:c1].to(dtype)
        if self.kind == "row":
            return tb[:, 0:1, c0:c1].to(dtype)
        idx = self._alibi_index(r0, r1, c0, c1)
        return tb[:, ALIBI_ROWS - 1, :].to(dtype)[:, idx]

    def accumulate_grad(self, grad: torch.Tensor, b: int, r0: int, r1: int, c0: int, c1: int, heads: slice,
                        g: torch.Tensor) -> None:
        """Add the tile gradient ``g`` [Nh, r, c] into ``grad`` (the pse's shape, compute dtype)."""
        gb = self._batch_view(grad, b)[heads]
        if self.kind == "full":
            gb[:, r0:r1, c0:c1] += g
        elif self.kind == "row":
            gb[:, 0, c0:c1] += g.sum(1)
        else:
            idx = self._alibi_index(r0, r1, c0, c1).reshape(1, -1).expand(g.shape[0], -1)
            gb[:, ALIBI_ROWS - 1, :].scatter_add_(1, idx, g.reshape(g.shape[0], -1))


def _start(name: str, value) -> int:
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    values = int_list(name, value)
    return values[0] if values else 0


def _masks_upper_triangle(mask: MaskSpec, seq: SeqInfo) -> bool:
    for b in range(seq.batch):
        if mask.hi[b] <= 0 and mask.prefix is None:
            continue
        sq, skv = seq.q_lens[b], seq.kv_lens[b]
        m = mask.masked_block(b, 0, sq, 0, skv)
        upper = torch.ones(sq, skv, dtype=torch.bool).triu(1)
        if m is None or not bool(m[:, upper].all()):
            return False
    return True


def build_pse_spec(pse: torch.Tensor | None, *, pse_type: int, seq: SeqInfo | DeviceSeqLens, n1: int,
                   dtype: torch.dtype, mask: MaskSpec | MaskRule, sparse_mode: int, q_start_idx=None,
                   kv_start_idx=None, bottom_right: bool = False) -> PseSpec | None:
    """Validate ``pse`` against ``pse_type`` and the geometry; None when there is no pse. With lengths in device
    tensors the checks that need their values (Sq == Skv for ALiBi, segment sizes) cannot run; the forms that
    cannot be told apart without them (the 1-D TND pse) or need them checked (the ALiBi-compressed pse with an
    explicit mask) are refused. ``bottom_right``: see :class:`PseSpec` (slopes only)."""
    require(pse_type in PSE_TYPES, "pse_type", f"one of {list(PSE_TYPES)}", pse_type)
    require(isinstance(bottom_right, bool), "pse_bottom_right", "a bool", bottom_right)
    require(not bottom_right or pse is None or pse_type in (2, 3), "pse_bottom_right",
            "False unless pse holds ALiBi slopes (pse_type 2/3)", bottom_right)
    if pse is None:
        return None
    check_tensor("pse", pse)
    require(not (seq.packed and sparse_mode == 7), "pse", "None with sparse_mode 7 (not supported by the operator)",
            pse)
    device = isinstance(seq, DeviceSeqLens)
    unbounded = device and not seq.bounds_given  # device lengths bounded by the pse's extents, not checked here
    if not device and not bottom_right:  # flash-attn's ALiBi takes empty sequences
        require(all(n > 0 for n in seq.q_lens), "pse",
                "None when some batch has a query length of 0 (actual_seq_qlen repeats a value)", pse)
    if pse_type in (2, 3):
        return _slopes_spec(pse, pse_type, seq, n1, sparse_mode, _start("q_start_idx", q_start_idx),
                            _start("kv_start_idx", kv_start_idx), bottom_right)
    if pse.dtype != dtype:
        fail("pse", f"dtype {dtype} (same as query) for pse_type {pse_type}", pse)
    if pse.dim() == 1:
        require(not device, "pse", "a 4-D pse with cu_seqlens tensors on the device (the 1-D TND pse is read by "
                "the host lengths)", pse, "pass actual_seq_qlen/actual_seq_kvlen lists (or CPU cu_seqlens)")
        return _flattened_spec(pse, pse_type, seq, n1)
    require(pse.dim() == 4 and pse.shape[1] == n1 and pse.shape[0] in (1, seq.batch), "pse",
            f"a 4-D [B|1, N1={n1}, Sq, Skv] tensor (B={seq.batch}) for pse_type {pse_type}", pse)
    rows, cols = pse.shape[2], pse.shape[3]
    sq, skv = seq.max_q, seq.max_kv
    if rows == ALIBI_ROWS and (seq.packed or sq > ALIBI_ROWS):  # TND: the 4-D 1024-row pse is always compressed
        if device:
            require(sparse_mode in (2, 3) and mask.explicit is None, "pse", "a causal mask (causal=True, "
                    "sparse_mode 2/3) with the ALiBi-compressed pse and cu_seqlens tensors on the device",
                    Described(f"sparse_mode={sparse_mode}"), "pass host lengths to use sparse_mode 0 with a mask")
        else:
            require(all(a == b for a, b in zip(seq.q_lens, seq.kv_lens)), "pse",
                    "Sq == Skv for every batch with the ALiBi-compressed [.., 1024, Skv] pse", pse)
            require(sparse_mode in (0, 2, 3) and _masks_upper_triangle(mask, seq), "pse",
                    "a causal (lower-triangular) mask with the ALiBi-compressed pse (sparse_mode 0/2/3)",
                    Described(f"sparse_mode={sparse_mode}"))
        require(cols >= skv or unbounded, "pse", f"a last dim >= Skv={skv} for the ALiBi-compressed pse", pse)
        return PseSpec(pse_type, "alibi", pse)
    if rows == 1:
        require(cols == skv or (seq.packed and cols >= skv) or unbounded, "pse",
                f"[B|1, N1, 1, Skv={skv}] (row broadcast)", pse)
        return PseSpec(pse_type, "row", pse)
    ok = (rows == sq and cols == skv) or (seq.packed and rows >= sq and cols >= skv) or unbounded
    require(ok, "pse", f"[B|1, N1, Sq={sq}, Skv={skv}], [B, N1, 1, Skv] or the ALiBi-compressed "
            "[B|1, N1, 1024, Skv] (TND: always; other layouts: when Sq > 1024)", pse)
    return PseSpec(pse_type, "full", pse)


def pse_extents(pse: PseSpec | None) -> tuple[int | None, int | None]:
    """The query rows and key columns a pse covers (None: any), which bound lengths the host cannot check."""
    if pse is None or pse.kind == "slopes":
        return None, None
    cols = pse.tensor.shape[-1]
    if pse.kind == "alibi":  # read along the diagonal: its gradient needs Sq <= W as well
        return cols, cols
    return (pse.tensor.shape[2] if pse.kind == "full" else None), cols


def _flattened_spec(pse: torch.Tensor, pse_type: int, seq: SeqInfo, n1: int) -> PseSpec:
    """The 1-D TND pse: per-batch ``[N1, 1, Skv_b]`` (length ``N1*sum(Skv_b)``) or ``[N1, Sq_b, Skv_b]`` segments
    (length ``N1*sum(Sq_b*Skv_b)``), laid end to end in batch order."""
    require(seq.packed, "pse", f"a 4-D [B|1, N1={n1}, Sq, Skv] tensor (the 1-D pse is for the TND layout only)", pse)
    row_total = n1 * sum(seq.kv_lens)
    full_total = n1 * sum(a * c for a, c in zip(seq.q_lens, seq.kv_lens))
    length = pse.shape[0]
    require(length in (row_total, full_total), "pse",
            f"a 1-D TND pse of length N1*sum(Skv_b)={row_total} (per-batch [N1, 1, Skv_b]) or "
            f"N1*sum(Sq_b*Skv_b)={full_total} (per-batch [N1, Sq_b, Skv_b])", Described(f"length {length}"))
    row = length == row_total
    segments, off = [], 0
    for sq, skv in zip(seq.q_lens, seq.kv_lens):
        rows = 1 if row else sq
        segments.append((off, n1, rows, skv))
        off += n1 * rows * skv
    return PseSpec(pse_type, "row" if row else "full", pse, segments=tuple(segments))


def _slopes_spec(slopes, pse_type, seq: SeqInfo | DeviceSeqLens, n1, sparse_mode, q_start, kv_start,
                 bottom_right: bool) -> PseSpec:
    if slopes.dtype != torch.float32:
        fail("pse", f"float32 ALiBi slopes for pse_type {pse_type}", slopes)
    ok = (slopes.dim() == 1 and slopes.shape[0] == n1) or (slopes.dim() == 2 and tuple(slopes.shape) == (seq.batch, n1))
    require(ok, "pse", f"slopes of shape [B={seq.batch}, N1={n1}] or [N1={n1}] for pse_type {pse_type}", slopes)
    first_only = seq.packed and sparse_mode == 8 and not bottom_right
    rule = dict(start_idx=(q_start, kv_start), first_batch_only=first_only, bottom_right=bottom_right)
    if isinstance(seq, DeviceSeqLens):
        return PseSpec(pse_type, "slopes", slopes, **rule)
    if bottom_right:
        qs = tuple(q_start + skv - sq for sq, skv in zip(seq.q_lens, seq.kv_lens))
        return PseSpec(pse_type, "slopes", slopes, qs, (kv_start,) * seq.batch, **rule)
    qs, ks = [], []
    for b, (sq, skv) in enumerate(zip(seq.q_lens, seq.kv_lens)):
        if first_only and b == 0:
            require(sq - skv + q_start - kv_start == 0, "q_start_idx",
                    "actual_seq_qlen[0] - actual_seq_kvlen[0] + q_start_idx - kv_start_idx == 0 "
                    "for sparse_mode 8 with pse_type 2/3", Described(f"Sq={sq}, Skv={skv}, q_start_idx={q_start}, "
                    f"kv_start_idx={kv_start}"))
        else:
            require(sq == skv, "pse", f"Sq == Skv for internally generated ALiBi (pse_type {pse_type})",
                    Described(f"Sq={sq}, Skv={skv} in batch {b}"))
        keep_start = not (first_only and b > 0)
        qs.append(q_start if keep_start else 0)
        ks.append(kv_start if keep_start else 0)
    return PseSpec(pse_type, "slopes", slopes, tuple(qs), tuple(ks), **rule)
