"""Arguments of the Triton FlashAttention kernels, built per call on the host: operand views and strides,
per-batch metadata (host lists or the prepare kernel on device lengths), statistics geometry, and the pse,
explicit-mask and dropout arguments."""
from __future__ import annotations

import torch

from ...._core import staging
from ...._core.layouts import token_strides, tokens_view
from ...._core.masks import INF
from ...._core.pse import ALIBI_ROWS
from ...._core.softmax_stats import STAT_LANES
from ...._core.triton.launch import Launch, cdiv, placeholder, unit_last_stride
from ..problem import FAProblem
from .autotune import TAIL_BLOCK, TAIL_PROGRAMS

PSE_KINDS = {"full": 1, "row": 2, "alibi": 3}  # common.PSE_FULL / PSE_ROW / PSE_ALIBI; slopes: 4 + (type 3)
MASK_STRIDED_CAUSAL = 2  # common.MASK_STRIDED_CAUSAL: HAS_EXPLICIT of a masks.StridedCausal rule



def token_view(x: torch.Tensor, p: FAProblem, heads: int) -> torch.Tensor:
    """``x`` as ``[B, S, N, D]`` / ``[T, N, D]`` with a unit last stride (copied only when it has none)."""
    return tokens_view(unit_last_stride(x), p.layout, heads)


def operand(p: FAProblem, x: torch.Tensor, kv: bool = False) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``x`` (copied only without a unit last stride) and the (batch, token, head) strides at which the kernels
    address it, with the query's heads or the key's (``kv``): those of :func:`token_view` (TND: batch stride 0,
    tokens addressed by offsets), without making the view."""
    x = unit_last_stride(x)
    return x, token_strides(x, p.layout, p.geom.n2 if kv else p.geom.n1)


def stat_row(p: FAProblem) -> int:
    """Elements between consecutive rows of a head in the statistics buffers (8 lanes per row)."""
    return p.geom.n1 * STAT_LANES if p.seq.packed and p.softmax_layout == "TND" else STAT_LANES


def stats_geometry(p: FAProblem) -> tuple[list[int], list[int], int]:
    """Per-batch (element offset, head stride) and the row stride of the statistics buffers (8 lanes per row), for
    host lengths."""
    seq, n1 = p.seq, p.geom.n1
    if not seq.packed:
        return ([b * n1 * seq.max_q * STAT_LANES for b in range(seq.batch)], [seq.max_q * STAT_LANES] * seq.batch,
                STAT_LANES)
    base = [s * n1 * STAT_LANES for s in seq.q_starts]
    if p.softmax_layout == "TND":
        return base, [STAT_LANES] * seq.batch, stat_row(p)
    return base, [sq * STAT_LANES for sq in seq.q_lens], STAT_LANES


def _slopes(p) -> bool:
    return p.pse is not None and p.pse.kind == "slopes"


def _meta_rows(p: FAProblem) -> torch.Tensor:
    """The metadata rows of host lengths, on the host."""
    seq, mask = p.seq, p.mask
    stat_base, stat_head, _ = stats_geometry(p)
    slopes = _slopes(p)
    rows = []
    for b in range(seq.batch):
        qs, ks = (seq.q_starts[b], seq.kv_starts[b]) if seq.packed else (0, 0)
        rows.append([qs, ks, seq.q_lens[b], seq.kv_lens[b], max(mask.lo[b], -INF), min(mask.hi[b], INF),
                     mask.prefix[b] if mask.prefix is not None else 0,
                     p.dropout.block_offsets[b] if p.dropout is not None else 0,
                     p.pse.q_start[b] if slopes else 0, p.pse.kv_start[b] if slopes else 0,
                     stat_base[b], stat_head[b]])
    return torch.tensor(rows, dtype=torch.int64).reshape(seq.batch, 12)


def batch_meta(p: FAProblem, device: torch.device) -> torch.Tensor:
    """The int64 ``[B, 12]`` per-batch metadata (columns ``common.META_FIELDS``) of a problem with host lengths,
    built and uploaded (pinned, non-blocking) once per batch composition: a repeated call reuses the same device
    tensor (never written to)."""
    seq, mask = p.seq, p.mask
    slopes = _slopes(p)
    key = ("flash_attention.meta", seq, mask.lo, mask.hi, mask.prefix,
           p.dropout.block_offsets if p.dropout is not None else None,
           (p.pse.q_start, p.pse.kv_start) if slopes else None, p.softmax_layout, p.geom.n1)
    return staging.cached_upload(key, lambda: _meta_rows(p), torch.int64, device)


_SPECIAL = {None: 0, "last": 1, "first": 2}  # prepare.SPECIAL_*


def _prepare_launch(p: FAProblem, meta: torch.Tensor) -> Launch:
    """The prepare kernel's launch filling ``meta`` (``[B + 1, 12]``) from the ``cu_seqlens`` tensors."""
    seq, band, device = p.seq, p.mask.band, meta.device
    prefix = p.mask.prefix
    prefix_t = placeholder(device, torch.int64) if prefix is None else staging.cached_upload(
        ("flash_attention.prefix", prefix), lambda: list(prefix), torch.int64, device)
    slopes = _slopes(p)
    q_start, kv_start = p.pse.start_idx if slopes else (0, 0)
    return Launch("prepare_kernel", (1,),
                  (meta, seq.cu_q, seq.cu_kv, prefix_t, seq.batch, p.total_q, p.total_kv, seq.max_q, seq.max_kv,
                   p.geom.n1, band.lo, band.hi, band.special_lo, band.special_hi, q_start, kv_start, INF),
                  dict(LO_DELTA=band.lo_delta, HI_DELTA=band.hi_delta, SPECIAL=_SPECIAL[band.special],
                       HAS_PREFIX=prefix is not None, SLOPES=_slopes_mode(p.pse) if slopes else 0,
                       STATS_TND=p.softmax_layout == "TND"))


def _slopes_mode(pse) -> int:
    """The prepare kernel's ``SLOPES`` for ALiBi slopes ``pse`` (prepare.SLOPES_*)."""
    return 3 if pse.bottom_right else 2 if pse.first_batch_only else 1


def device_metadata(p: FAProblem, device: torch.device) -> tuple[torch.Tensor | None, list[Launch]]:
    """For device lengths, the per-batch metadata to fill and the prepare kernel's launch filling it (its extra last
    row holds the ends of the sequences); ``(None, [])`` for host lengths (:func:`batch_meta`)."""
    if not p.device_lengths:
        return None, []
    meta = torch.empty((p.seq.batch + 1, 12), dtype=torch.int64, device=device)
    return meta, [_prepare_launch(p, meta)]


def tails(p: FAProblem, meta: torch.Tensor, side: int, fills) -> list[Launch]:
    """Fill the rows of the TND tokens past every sequence (``side`` 0: query tokens, 1: key/value tokens) of the
    contiguous buffers in ``fills`` (``(buffer, value)`` pairs): in place for host lengths, else as tail kernel
    launches that read the ends the prepare kernel wrote."""
    if not p.seq.packed:
        return []
    if not p.device_lengths:
        end = sum(p.seq.kv_lens if side else p.seq.q_lens)
        for buf, value in fills:
            if end < buf.shape[0]:
                buf[end:].fill_(value)
        return []
    end_col = side  # the metadata row past the last batch holds the query end in column 0, the key end in 1
    return [Launch("tail_kernel", (min(cdiv(buf.numel(), TAIL_BLOCK), TAIL_PROGRAMS),),
                   (buf, meta, end_col, p.seq.batch, buf.numel(), buf.numel() // buf.shape[0], value), {})
            for buf, value in fills if buf.numel() > 0]


def pse_args(p: FAProblem, device: torch.device, dummy: torch.Tensor) -> tuple[list, dict]:
    """Pointer/strides of the pse source and its kernel flags (``p``: any problem with a ``PseSpec`` ``pse``, the
    FusedInferAttention one too)."""
    pse = p.pse
    if pse is None:
        return [dummy, 0, 0, 0, 0], dict(PSE=0, PSE_BEFORE_SCALE=False)
    t = (pse.padded() if pse.flattened else pse.tensor).to(device)
    if pse.kind == "slopes":
        t = t.contiguous()
        sb = t.stride(0) if t.dim() == 2 else 0
        return [t, sb, t.stride(-1), 0, 0], dict(PSE=4 + (pse.pse_type == 3), PSE_BEFORE_SCALE=False)
    t = t if t.stride(-1) == 1 else t.contiguous()
    return ([t, t.stride(0) if t.shape[0] > 1 else 0, t.stride(1), t.stride(2), t.shape[-1]],
            dict(PSE=PSE_KINDS[pse.kind], PSE_BEFORE_SCALE=pse.add_before_scale))


ALIBI_COPIES = 8  # shifted copies of the ALiBi-compressed pse's row 1023: 16 bytes of fp16/bf16
PSE_ALIBI_COPIES = 6  # common.PSE_ALIBI_COPIES


def alibi_copies(p: FAProblem, device: torch.device) -> list:
    """The forward's pse arguments for the ALiBi-compressed pse: its row 1023 (``[Bp, N1, W]``) as
    ``[Bp, N1, 8, L]`` copies, copy ``k`` shifted right by ``k`` elements and zero elsewhere, so that the kernel
    reads each score row's diagonal run ``W - 1 - r + c0 ..`` from the copy where it starts 16-byte aligned (a
    vector load; the tensor itself gives every row another alignment). ``L`` covers the largest aligned start
    plus a tile of 128 columns, so the reads need no column mask."""
    row = p.pse.tensor.to(device)[:, :, ALIBI_ROWS - 1, :]
    w = row.shape[-1]
    length = -(-(w + ALIBI_COPIES + 128) // 16) * 16
    copies = row.new_zeros((row.shape[0], row.shape[1], ALIBI_COPIES, length))
    for k in range(ALIBI_COPIES):
        copies[:, :, k, k:k + w] = row
    return [copies, copies.stride(0) if copies.shape[0] > 1 else 0, copies.stride(1), copies.stride(2), w]


def mask_args(p: FAProblem, device: torch.device, dummy: torch.Tensor) -> tuple[list, dict]:
    """Pointer/strides of the explicit mask (bool read as uint8, broadcast dims at stride 0) and its kernel flag
    (``p``: any problem with a ``MaskSpec`` ``mask``, the FusedInferAttention one too); a formula mask
    (``masks.StridedCausal``) passes its stride and shift in the stride slots instead, and reads no tensor."""
    strided, e = p.mask.strided, p.mask.explicit
    if strided is not None:
        return [dummy, 0, strided.shift, strided.stride], dict(HAS_EXPLICIT=MASK_STRIDED_CAUSAL)
    if e is None:
        return [dummy, 0, 0, 0], dict(HAS_EXPLICIT=False)
    e = e.to(device)
    e = (e if e.stride(-1) == 1 else e.contiguous()).view(torch.uint8)
    return ([e, e.stride(0) if e.shape[0] > 1 else 0, e.stride(1) if e.shape[1] > 1 else 0, e.stride(2)],
            dict(HAS_EXPLICIT=True))


def packed_words(packed: torch.Tensor) -> torch.Tensor:
    """A packed dropout mask (uint8, LSB first) as the int32 words the kernels read (``common.dropout_scale``): a
    view when it is contiguous and whole words long and aligned, else a zero-padded copy (zero bits drop, as the
    bytes past the mask do)."""
    flat = packed.reshape(-1)
    if flat.numel() % 4 == 0 and flat.storage_offset() % 4 == 0:
        return flat.view(torch.int32)
    return torch.cat([flat, flat.new_zeros(-flat.numel() % 4)]).view(torch.int32)


def explicit_cols(p: FAProblem) -> int:
    """The columns of the explicit mask tensor (0 without one): the forward's load bound for it."""
    return 0 if p.mask.explicit is None else p.mask.explicit.shape[-1]


def dropout_args(p: FAProblem, device: torch.device, dummy: torch.Tensor) -> tuple[list, dict]:
    """Dropout pointer and scalars: Philox ``(seed, offset)``, or a packed mask as int32 words with their number (the
    kernels read no word past them)."""
    d = p.dropout
    if d is None:
        return [dummy, 1.0, 0, 0], dict(DROPOUT=0)
    if d.packed is not None:
        words = packed_words(d.packed.to(device))
        return [words, d.keep_prob, 0, words.numel()], dict(DROPOUT=2)
    return [dummy, d.keep_prob, d.seed, d.offset], dict(DROPOUT=1)


