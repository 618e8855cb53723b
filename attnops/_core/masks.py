"""Sparse modes -> the one mask normal form (:class:`MaskSpec`).

keep(i, j) iff ``(lo_b <= j - i <= hi_b  OR  j < prefix_b)  AND  NOT explicit[b, n, i, j]``, where the explicit
mask may be a rule instead of a tensor (:class:`StridedCausal`, NSA's compressed causal mask, computed by the kernels).
Every sparse mode of every operator is converted here, once, on the host (``cann_semantics.md`` §1.1/§1.2):
:func:`build_mask_spec` for training FlashAttention, :func:`build_infer_mask_spec` for FusedInferAttentionScore.
A training sparse mode is first a :class:`BandRule` (the band as a function of each batch's lengths), evaluated on
the host for host lengths and by the FlashAttention prepare kernel for lengths in device tensors
(:class:`MaskRule`). Compressed 2048x2048 / 3072x2048 masks are replaced by the analytic band (their content is
checked on the CPU only: the kernels never read them); full CPU masks that are a band on every batch (a causal
``triu`` mask, a sliding window) are replaced by it too (:func:`_with_explicit`).
"""
from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .checks import Described, check_tensor, fail, int_list, require
from .varlen import DeviceSeqLens, SeqInfo, batch_windows

INF = 1 << 62  # "no limit" for band offsets
MASK_DTYPES = (torch.bool, torch.uint8)
INFER_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
INFER_SPARSE_MODES = (0, 1, 2, 3, 4)
COMPRESSED_CAUSAL_MODES = (2, 3, 4, 7, 8)
COMPRESSED_PREFIX_MODE = 6


@dataclass(frozen=True)
class StridedCausal:
    """The explicit mask ``masked(i, j) = j * stride + shift > i`` as a rule (never stored): key ``j`` stands for
    positions ``j * stride .. j * stride + shift`` (NSA's compressed block ``j``, ``shift = block - 1``) and is visible
    to query row ``i`` once complete."""

    stride: int
    shift: int

    def block(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """Bool ``[1, r1 - r0, c1 - c0]`` (True = masked) of rows ``[r0, r1)`` x columns ``[c0, c1)``."""
        ends = torch.arange(c0, c1) * self.stride + self.shift
        return (ends.unsqueeze(0) > torch.arange(r0, r1).unsqueeze(1)).unsqueeze(0)


@dataclass(frozen=True)
class MaskSpec:
    """Per-batch band ``lo <= j - i <= hi``, optional prefix columns and optional explicit mask.

    ``explicit`` is bool ``[Bm, Nm, R, C]`` (True = masked) with ``Bm`` in {1, B} and ``Nm`` in {1, N1};
    batch ``b`` uses the top-left ``[:Sq_b, :Skv_b]`` slice. ``strided`` is an explicit mask given as a formula
    (:class:`StridedCausal`; the same for every batch and head), exclusive with ``explicit``.
    """

    lo: tuple[int, ...]
    hi: tuple[int, ...]
    prefix: tuple[int, ...] | None = None
    explicit: torch.Tensor | None = None
    strided: StridedCausal | None = None

    def batch(self, b: int) -> "MaskSpec":
        """The spec of batch ``b`` alone (as a one-batch spec)."""
        e = self.explicit
        return MaskSpec((self.lo[b],), (self.hi[b],), None if self.prefix is None else (self.prefix[b],),
                        e if e is None or e.shape[0] == 1 else e[b:b + 1], self.strided)

    @property
    def has_explicit(self) -> bool:
        """An explicit mask, as a tensor or as a rule: entries the band keeps may still be masked."""
        return self.explicit is not None or self.strided is not None

    @property
    def is_full(self) -> bool:
        return not self.has_explicit and self.prefix is None and all(
            lo <= -INF and hi >= INF for lo, hi in zip(self.lo, self.hi))

    def col_range(self, b: int, r0: int, r1: int, skv: int) -> tuple[int, int]:
        """Columns ``[c0, c1)`` that may be kept for query rows ``[r0, r1)`` (empty when c0 >= c1)."""
        c0 = max(0, r0 + self.lo[b]) if self.lo[b] > -INF else 0
        c1 = min(skv, r1 - 1 + self.hi[b] + 1) if self.hi[b] < INF else skv
        if self.prefix is not None and self.prefix[b] > 0:
            p = min(self.prefix[b], skv)
            c0, c1 = (0, max(c1, p)) if c0 < c1 else (0, p)
        return c0, c1

    def _band_masked(self, b: int, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """Bool [r, c]: True where the band (or prefix) excludes (i, j) for rows r0:r1, columns c0:c1."""
        masked = _outside_band(self.lo[b], self.hi[b], r0, r1, c0, c1)
        if self.prefix is not None and self.prefix[b] > 0:
            masked &= torch.arange(c0, c1).unsqueeze(0) >= self.prefix[b]
        return masked

    def _explicit_block(self, b: int, r0: int, r1: int, c0: int, c1: int, heads: slice | None):
        if self.strided is not None:
            return self.strided.block(r0, r1, c0, c1)
        e = self.explicit[b if self.explicit.shape[0] > 1 else 0]
        if heads is not None and e.shape[0] > 1:
            e = e[heads]
        return e[:, r0:r1, c0:c1]

    def masked_block(self, b: int, r0: int, r1: int, c0: int, c1: int, heads: slice | None = None):
        """Bool ``[1 or Nh, r1-r0, c1-c0]`` (True = masked) for a tile, or None when the tile is fully kept."""
        masked = None
        if not (c0 - (r1 - 1) >= self.lo[b] and (c1 - 1) - r0 <= self.hi[b]):
            masked = self._band_masked(b, r0, r1, c0, c1).unsqueeze(0)
        if self.has_explicit:
            e = self._explicit_block(b, r0, r1, c0, c1, heads)
            masked = e if masked is None else (masked | e)
        return masked

    def keeps_every_row(self, b: int, r0: int, r1: int, c0: int, c1: int) -> bool:
        """Whether every row of ``[r0, r1)`` keeps at least one column of ``[c0, c1)`` (False with an explicit
        mask, which may mask anything)."""
        if self.has_explicit or c0 >= c1:
            return False
        if self.prefix is not None and self.prefix[b] > c0:
            return True  # column c0 is a prefix column
        return r0 + self.hi[b] >= c0 and r1 - 1 + self.lo[b] < c1  # row i keeps [i + lo, i + hi]

    def edge_spans(self, b: int, r0: int, r1: int, c0: int, c1: int) -> list[tuple[int, int]]:
        """The column spans of tile rows ``[r0, r1)`` x columns ``[c0, c1)`` that the band's left and right edges
        cross: columns every row keeps, and prefix columns, are left out."""
        pfx = self.prefix[b] if self.prefix is not None else 0
        lo, hi = self.lo[b], self.hi[b]
        left_end = min(c1, r1 - 1 + lo) if lo > -INF else c0  # columns [c0, left_end) may be left of the band
        right_start = max(c0, r0 + hi + 1) if hi < INF else c1  # columns [right_start, c1) may be right of it
        spans = ((max(c0, pfx), left_end), (max(right_start, pfx, left_end), c1))
        return [(e0, e1) for e0, e1 in spans if e0 < e1]

    def band_bounds(self, b: int, r0: int, r1: int, c0: int, c1: int) -> list[tuple[int, int, torch.Tensor]]:
        """The band of a tile as ``[(a, z, bound)]``: tile columns ``[a, z)`` (its :meth:`edge_spans`) and an fp32
        ``[r1 - r0, z - a]`` bound, -inf where the band masks the entry and +inf where it keeps it, so that
        ``scores[..., a:z].clamp_(max=bound)`` masks them (several times faster than ``masked_fill_``)."""
        return [(e0 - c0, e1 - c0, _band_bound(self.lo[b], self.hi[b], e0 - r0, r1 - r0, e1 - e0))
                for e0, e1 in self.edge_spans(b, r0, r1, c0, c1)]

    def tile_band(self, b: int, r0: int, r1: int, c0: int, c1: int) -> tuple[int, int, int]:
        """The band as ``(lo, hi, prefix)`` in tile coordinates, unbounded sides clamped to the tile: row ``i`` keeps
        column ``j`` iff ``lo <= j - i <= hi`` or ``j < prefix`` (what :meth:`fill_masked_` masks, for C kernels)."""
        pfx = 0 if self.prefix is None else min(max(self.prefix[b] - c0, 0), c1 - c0)
        return max(self.lo[b] + r0 - c0, r0 - r1), min(self.hi[b] + r0 - c0, c1 - c0), pfx

    def fill_masked_(self, scores: torch.Tensor, b: int, r0: int, r1: int, c0: int, c1: int,
                     heads: slice | None = None, band: list | None = None) -> torch.Tensor:
        """Set the masked entries of a score tile ``[Nh, r, c]`` to -inf in place.

        Only the columns at the band's edges are tested element by element (``band``: this tile's
        :meth:`band_bounds` when the caller has them); columns every row keeps are skipped. A NaN score is
        masked too (``clamp_`` would keep it): a span whose sum is NaN takes the slower ``where``.
        """
        for a, z, bound in self.band_bounds(b, r0, r1, c0, c1) if band is None else band:
            span = scores[..., a:z]
            if math.isnan(span.sum()):  # rare: non-finite inputs (the sum read as a float: one op fewer)
                span.copy_(torch.where(bound > 0, span, bound))
            else:
                span.clamp_(max=bound)
        if self.has_explicit:
            scores.masked_fill_(self._explicit_block(b, r0, r1, c0, c1, heads), float("-inf"))
        return scores


@dataclass(frozen=True)
class BandRule:
    """A sparse mode's band as a rule of each batch's lengths, ``delta_b = Skv_b - Sq_b``: ``lo_b = lo`` (plus
    ``delta_b`` with ``lo_delta``) and ``hi_b = hi`` (plus ``delta_b`` with ``hi_delta``), ``-INF``/``INF`` meaning
    unbounded. With ``special`` (``"last"``/``"first"``: sparse modes 7/8), the last/first batch with queries keeps
    ``delta_b + special_lo <= j - i <= delta_b + special_hi`` instead. :meth:`bands` evaluates it on host lengths;
    the FlashAttention prepare kernel evaluates the same rule on lengths in device tensors."""

    lo: int = -INF
    lo_delta: bool = False
    hi: int = INF
    hi_delta: bool = False
    special: str | None = None
    special_lo: int = 0
    special_hi: int = 0

    def bands(self, q_lens, kv_lens) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-batch ``(lo, hi)`` tuples for host lengths."""
        deltas = [kv - q for q, kv in zip(q_lens, kv_lens)]
        lo = [self.lo + d if self.lo_delta else self.lo for d in deltas]
        hi = [self.hi + d if self.hi_delta else self.hi for d in deltas]
        if self.special is not None:
            nonempty = [b for b, q in enumerate(q_lens) if q > 0]
            if nonempty:
                b = nonempty[-1] if self.special == "last" else nonempty[0]
                lo[b], hi[b] = deltas[b] + self.special_lo, deltas[b] + self.special_hi
        return tuple(lo), tuple(hi)


def band_rule(sparse_mode: int, pre_tokens: int, next_tokens: int) -> BandRule:
    """The band of a training-FA sparse mode (``cann_semantics.md`` §1.1; the modes that take a mask)."""
    if sparse_mode == 0:
        return BandRule(-pre_tokens, False, next_tokens, False)
    if sparse_mode == 1:
        return BandRule()
    if sparse_mode == 2:
        return BandRule(hi=0)
    if sparse_mode == 4:
        return BandRule(-pre_tokens, True, next_tokens, True)
    if sparse_mode in (7, 8):  # varlen externally split: one batch is a bottom-right band with the user's tokens
        return BandRule(hi=0, hi_delta=sparse_mode == 7, special="last" if sparse_mode == 7 else "first",
                        special_lo=-pre_tokens, special_hi=next_tokens)
    return BandRule(hi=0, hi_delta=True)  # 3, 5, 6: bottom-right causal


@dataclass(frozen=True)
class MaskRule:
    """The mask of a call whose sequence lengths are device tensors: the :class:`BandRule`, the prefix list and the
    explicit mask (read by the kernels as given; never recognised as a band on the host), and the formula mask
    (``MaskSpec.strided``)."""

    band: BandRule
    prefix: tuple[int, ...] | None = None
    explicit: torch.Tensor | None = None
    strided: StridedCausal | None = None


@functools.lru_cache(maxsize=64)
def _band_bound(lo: int, hi: int, offset: int, rows: int, cols: int) -> torch.Tensor:
    """fp32 ``[rows, cols]``: -inf where ``offset + j - i`` is outside ``[lo, hi]``, else +inf (cached by the tile's
    shape relative to the band, so the tiles along a band share one; never written to)."""
    inf = torch.tensor(float("inf"))
    return torch.where(_outside_band(lo, hi, 0, rows, offset, offset + cols), -inf, inf)


def _outside_band(lo: int, hi: int, r0: int, r1: int, c0: int, c1: int, device=None) -> torch.Tensor:
    """Bool ``[r1 - r0, c1 - c0]``: True where ``j - i`` is outside ``[lo, hi]`` (rows ``r0:r1``, columns
    ``c0:c1``; ``-INF``/``INF``: that side unlimited)."""
    ones = torch.ones(r1 - r0, c1 - c0, dtype=torch.bool, device=device)
    masked = torch.zeros_like(ones)
    if hi < INF:
        masked |= ones.triu(hi + 1 + r0 - c0)
    if lo > -INF:
        masked |= ones.tril(lo - 1 + r0 - c0)
    return masked


@functools.cache
def _canonical_compressed(rows: int) -> torch.Tensor:
    """The canonical compressed mask with ``rows`` rows (2048: causal; 3072: causal + the prefix rectangle)."""
    want = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    if rows == 3072:
        rect = torch.zeros(1024, 2048, dtype=torch.bool)
        rect[:, 1024:] = True
        want = torch.cat([want, rect])
    return want


_MEMO: dict[tuple, tuple] = {}  # (id(mask), what) -> (weak reference, version counter, value)
MEMO_SIZE = 64


def _memo(mask: torch.Tensor, what: tuple, compute):
    """``compute()`` for this very mask tensor, remembered while it is unmodified (same version counter): callers
    pass the same mask to every layer and step, and reading millions of elements each time costs milliseconds.
    Only a weak reference is kept. Inference tensors have no version counter: computed every time."""
    if mask.is_inference():
        return compute()
    key = (id(mask), what)
    entry = _MEMO.get(key)
    if entry is not None and entry[0]() is mask and entry[1] == mask._version:
        return entry[2]
    value = compute()
    if len(_MEMO) >= MEMO_SIZE:
        _MEMO.clear()
    _MEMO[key] = (weakref.ref(mask), mask._version, value)
    return value


_KNOWN_CANONICAL: dict[int, weakref.ref] = {}  # id -> the compressed masks attnops built itself


def _known_canonical(mask: torch.Tensor) -> bool:
    ref = _KNOWN_CANONICAL.get(id(mask))
    return ref is not None and ref() is mask


def compressed_mask_key(atten_mask: torch.Tensor, sparse_mode) -> tuple | None:
    """What a training-FA compressed mask's validation depends on, when that is not its content (a device mask or
    one built by :func:`compressed_causal_mask`): its shape, dtype and device; None for every other mask."""
    compressed = sparse_mode in COMPRESSED_CAUSAL_MODES or sparse_mode == COMPRESSED_PREFIX_MODE
    if compressed and (atten_mask.device.type != "cpu" or _known_canonical(atten_mask)):
        return atten_mask.shape, atten_mask.dtype, atten_mask.device
    return None


HELD_MASK_ELEMENTS = 1 << 16  # the largest mask keyed by identity (a cache keeps at most its entries of them)


def held_mask_key(atten_mask: torch.Tensor) -> tuple | None:
    """What a full mask's validation depends on when its values are never read on the host: a small bool mask off
    the CPU (the spec holds views of it as given, the kernels read it; writing it in place changes nothing on the
    host): its identity and layout. A cache keyed on it keeps the mask alive with its entry (its identity cannot be
    reused meanwhile), so only masks of at most ``HELD_MASK_ELEMENTS`` entries qualify (a decoding step's, written
    into the same buffer at every step), never a large mask made afresh at every training step. None for every other
    mask (a CPU mask is read; another dtype is converted into a copy)."""
    if (atten_mask.device.type == "cpu" or atten_mask.dtype != torch.bool
            or atten_mask.numel() > HELD_MASK_ELEMENTS):
        return None
    return id(atten_mask), atten_mask.shape, atten_mask.stride(), atten_mask.storage_offset(), atten_mask.device


def _check_compressed(atten_mask: torch.Tensor, rows: int, mode: int) -> None:
    """A compressed mask's shape, and its content when it is on the CPU. The kernels never read a compressed mask
    (the mode defines the band), so reading a device mask back would only cost a synchronisation."""
    name = "atten_mask"
    ok = atten_mask.dim() >= 2 and tuple(atten_mask.shape[-2:]) == (rows, 2048) and all(
        s == 1 for s in atten_mask.shape[:-2])
    require(ok, name, f"the compressed [{rows}, 2048] mask for sparse_mode {mode} (leading dims 1)", atten_mask,
            "build it with torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)")
    if atten_mask.device.type != "cpu" or _known_canonical(atten_mask):
        return
    canonical = _memo(atten_mask, ("compressed", rows), lambda: torch.equal(
        atten_mask.reshape(rows, 2048).to(dtype=torch.bool), _canonical_compressed(rows)))
    if not canonical:
        what = "triu(ones(2048, 2048), diagonal=1)" if rows == 2048 else \
            "triu(ones(2048, 2048), 1) stacked on 1024 rows of [0]*1024 + [1]*1024"
        fail(name, f"the canonical compressed mask {what} for sparse_mode {mode}",
             Described("a tensor with other content"),
             "the NPU reads this mask as a sliding window; any other content is undefined")


def _explicit(atten_mask: torch.Tensor, seq: SeqInfo | DeviceSeqLens, n1: int, mode: int) -> torch.Tensor:
    """Validate a full (uncompressed) mask and return it as bool ``[Bm, Nm, R, C]``."""
    name = "atten_mask"
    shape = tuple(atten_mask.shape)
    if seq.packed:
        ok = atten_mask.dim() == 2 or (atten_mask.dim() == 4 and shape[:2] == (1, 1))
        if not isinstance(seq, DeviceSeqLens) or seq.bounds_given:  # else lengths are bounded by the mask's size
            ok = ok and shape[-2] >= seq.max_q and shape[-1] >= seq.max_kv
        require(ok, name, f"a [maxSq, maxSkv] = [>={seq.max_q}, >={seq.max_kv}] mask for varlen (TND) "
                f"sparse_mode {mode}; each batch uses its top-left [Sq_b, Skv_b] slice", atten_mask)
    else:
        b, sq, skv = seq.batch, seq.max_q, seq.max_kv
        allowed = [(b, n1, sq, skv), (b, 1, sq, skv), (1, 1, sq, skv), (sq, skv)]
        if mode == 5:
            allowed = [(b, n1, sq, skv), (b, 1, sq, skv)] + ([(1, 1, sq, skv), (sq, skv)] if b == 1 else [])
        require(shape in allowed, name, f"one of the shapes {[list(s) for s in allowed]} for sparse_mode {mode}",
                atten_mask)
    return _as_bool4d(atten_mask)


def _with_explicit(lo: tuple[int, ...], hi: tuple[int, ...], explicit: torch.Tensor, seq: SeqInfo,
                   atten_mask: torch.Tensor, what: tuple) -> MaskSpec:
    """The spec of band ``(lo, hi)`` and ``explicit`` (bool ``[Bm, Nm, R, C]``, from ``atten_mask``). An explicit
    mask that is itself a band on every batch (a causal ``triu`` mask, a sliding window) becomes that band, so
    tiles outside it are skipped and none reads the mask: exactly the same entries are kept. ``what`` (hashable)
    names how ``explicit`` was derived from ``atten_mask``: the finding is remembered for the same, unmodified
    mask (:func:`_memo`). Only CPU masks are read: a device mask stays explicit (the same entries are kept, the
    kernels read it), as reading it back would synchronise."""
    if atten_mask.device.type != "cpu":
        return MaskSpec(lo, hi, explicit=explicit)
    band = _memo(atten_mask, ("band", seq, *what), lambda: _explicit_band(explicit, seq))
    if band is None:
        return MaskSpec(lo, hi, explicit=explicit)
    return MaskSpec(tuple(map(max, lo, band[0])), tuple(map(min, hi, band[1])))


def _explicit_band(explicit: torch.Tensor, seq: SeqInfo) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Per batch, the band ``(lo, hi)`` that ``explicit`` (bool ``[Bm, Nm, R, C]``, True = masked) equals on the
    batch's top-left ``[Sq_b, Skv_b]`` slice in every head, or None (a batch whose slice is no band, or heads with
    different bands)."""
    bands: dict[tuple[int, int, int], tuple[int, int] | None] = {}
    heads = 1 if explicit.stride(1) == 0 else explicit.shape[1]  # an expanded [.., 1, ..] mask: one head to read
    lo, hi = [], []
    for b, (sq, skv) in enumerate(zip(seq.q_lens, seq.kv_lens)):
        key = (b if explicit.shape[0] > 1 else 0, sq, skv)
        if sq == 0 or skv == 0:
            band = (-INF, INF)  # nothing to mask
        elif key in bands:
            band = bands[key]
        else:
            band = bands[key] = _slice_band(explicit[key[0], 0, :sq, :skv])
            if band is not None and any(_slice_band(explicit[key[0], n, :sq, :skv]) != band for n in range(1, heads)):
                band = bands[key] = None
        if band is None:
            return None
        lo.append(band[0])
        hi.append(band[1])
    return tuple(lo), tuple(hi)


def _slice_band(m: torch.Tensor) -> tuple[int, int] | None:
    """``(lo, hi)`` when bool ``m`` (``[Sq, Skv]``, True = masked) masks exactly the entries outside
    ``lo <= j - i <= hi`` (``-INF``/``INF``: that side unlimited), else None. The band is read off the first and
    last rows (both must keep something), checked on a middle row, then on the whole slice."""
    sq, skv = m.shape
    top, bottom = (~m[0]).nonzero(), (~m[-1]).nonzero()
    if top.numel() == 0 or bottom.numel() == 0:
        return None
    top_last, bottom_first = int(top[-1]), int(bottom[0])
    hi = INF if top_last == skv - 1 else top_last
    lo = -INF if bottom_first == 0 else bottom_first - (sq - 1)
    mid = sq // 2
    if not torch.equal(m[mid:mid + 1], _outside_band(lo, hi, mid, mid + 1, 0, skv, m.device)):
        return None
    return (lo, hi) if torch.equal(m, _outside_band(lo, hi, 0, sq, 0, skv, m.device)) else None


def _as_bool4d(atten_mask: torch.Tensor) -> torch.Tensor:
    """A bool (True = masked) view/copy of a mask with leading dims added up to 4-D; non-zero bytes are masked."""
    m = atten_mask if atten_mask.dtype == torch.bool else atten_mask != 0
    while m.dim() < 4:
        m = m.unsqueeze(0)
    return m


def _check_band_tokens(pre: int, nxt: int, sq: int, skv: int) -> None:
    if nxt < 0:
        require(pre >= -nxt and -nxt < skv, "next_tokens",
                f"a negative value only with pre_tokens >= |next_tokens| and |next_tokens| < Skv={skv}",
                Described(f"next_tokens={nxt}, pre_tokens={pre}"))
    if pre < 0:
        require(nxt >= -pre and -pre < sq, "pre_tokens",
                f"a negative value only with next_tokens >= |pre_tokens| and |pre_tokens| < Sq={sq}",
                Described(f"pre_tokens={pre}, next_tokens={nxt}"))


def build_mask_spec(*, sparse_mode: int, atten_mask: torch.Tensor | None, pre_tokens: int, next_tokens: int,
                    prefix, seq: SeqInfo | DeviceSeqLens, n1: int, allowed_modes: tuple[int, ...]
                    ) -> MaskSpec | MaskRule:
    """Convert a training-FA sparse mode (0..8) and its mask/tokens/prefix into a :class:`MaskSpec` (host lengths)
    or a :class:`MaskRule` (lengths in device tensors, :class:`~attnops._core.varlen.DeviceSeqLens`)."""
    require(sparse_mode in allowed_modes, "sparse_mode",
            f"one of {list(allowed_modes)} for {'TND' if seq.packed else 'dense'} layouts", sparse_mode)
    device = isinstance(seq, DeviceSeqLens)
    if atten_mask is None:  # no mask: sparse_mode, pre and next are ignored (CANN doc)
        return MaskRule(BandRule()) if device else MaskSpec((-INF,) * seq.batch, (INF,) * seq.batch)
    check_tensor("atten_mask", atten_mask, dtypes=MASK_DTYPES)
    if sparse_mode in COMPRESSED_CAUSAL_MODES:
        _check_compressed(atten_mask, 2048, sparse_mode)
    if sparse_mode == COMPRESSED_PREFIX_MODE:
        _check_compressed(atten_mask, 3072, sparse_mode)
    if sparse_mode == 0:
        _check_band_tokens(pre_tokens, next_tokens, seq.max_q, seq.max_kv)
    rule = band_rule(sparse_mode, pre_tokens, next_tokens)
    explicit = _explicit(atten_mask, seq, n1, sparse_mode) if sparse_mode in (0, 1, 5) else None
    pfx = _prefix(prefix, seq) if sparse_mode in (5, 6) else None
    if device:
        return MaskRule(rule, pfx, explicit)
    lo, hi = rule.bands(seq.q_lens, seq.kv_lens)
    if sparse_mode in (0, 1):
        return _with_explicit(lo, hi, explicit, seq, atten_mask, (n1,))
    return MaskSpec(lo, hi, prefix=pfx, explicit=explicit)


def _prefix(prefix, seq: SeqInfo | DeviceSeqLens) -> tuple[int, ...]:
    """The per-batch prefix lengths, checked against host lengths (device lengths: the kernels clamp them)."""
    values = int_list("prefix", prefix)
    require(values is not None and len(values) >= seq.batch, "prefix",
            f"a list with one value per batch (B={seq.batch}) for sparse_mode 5/6", prefix)
    values = values[:seq.batch]
    if isinstance(seq, DeviceSeqLens):
        for b, p in enumerate(values):
            require(p >= 0, f"prefix[{b}]", "a value >= 0", p)
        return tuple(values)
    for b, (p, sq, skv) in enumerate(zip(values, seq.q_lens, seq.kv_lens)):
        lo = 0 if sq > skv else skv - sq
        require(lo <= p <= skv, f"prefix[{b}]", f"a value in [{lo}, {skv}] (Sq={sq}, Skv={skv})", p)
    return tuple(values)


def _infer_mask_view(atten_mask: torch.Tensor, *, decode: bool, batch: int, rows: int, cols: int) -> torch.Tensor:
    """Validate an FIA full mask and return it as ``[Bm, 1, R, C]`` (a view, its own dtype).

    Decode (Q_S = 1): ``(B, C)``, ``(B, 1, C)``, ``(B, 1, 1, C)``. Otherwise ``(R, C)``, ``(B|1, R, C)``,
    ``(B|1, 1, R, C)``. ``R >= rows`` and ``C >= cols`` (masks may be padded up to aligned sizes).
    """
    shape = tuple(atten_mask.shape)
    if decode:
        forms = "(B, KV_S), (B, 1, KV_S) or (B, 1, 1, KV_S)"
        ok = len(shape) in (2, 3, 4) and shape[0] == batch and all(s == 1 for s in shape[1:-1])
        as4d = (batch, 1, 1, shape[-1])
    else:
        forms = "(Q_S, KV_S), (B|1, Q_S, KV_S) or (B|1, 1, Q_S, KV_S)"
        ok = len(shape) == 2 or (len(shape) == 3 and shape[0] in (1, batch)) or (
            len(shape) == 4 and shape[0] in (1, batch) and shape[1] == 1)
        as4d = ((1,) * (4 - len(shape)) + shape) if len(shape) != 3 else (shape[0], 1, *shape[1:])
    ok = ok and as4d[-2] >= rows and as4d[-1] >= cols
    require(ok, "atten_mask", f"a mask of shape {forms} with B={batch}, Q_S >= {rows}, KV_S >= {cols}", atten_mask)
    return atten_mask.reshape(as4d)


def check_infer_mask(*, sparse_mode: int, atten_mask: torch.Tensor | None, pre_tokens: int, next_tokens: int,
                     batch: int, decode: bool, rows: int, cols: int, left_padding: bool = False) -> MaskRule:
    """Validate a FusedInferAttentionScore mask (``cann_semantics.md`` §1.2) and return its :class:`MaskRule`: the
    band as a rule of each batch's effective lengths and the explicit mask as ``[Bm, 1, R, C]`` in its own dtype
    (non-zero = masked), read at the batch's left-padding offsets (batch 0 when ``Bm = 1``).

    Decode (Q_S = 1) ignores ``sparse_mode``, ``pre_tokens`` and ``next_tokens`` and takes the ``(B, KV_S)`` mask.
    Otherwise modes 0-4: 0 = the mask plus the left-top band ``LU(pre, next)`` (the band is dropped without a mask
    or with left padding), 1 = the mask, 2/3/4 = the canonical 2048x2048 mask replaced by the left-up causal,
    right-down causal and bottom-right band. ``rows``/``cols`` are the least mask sizes (query S, KV S). The content
    of a compressed mask is checked on the CPU only (a device mask is not read on the host).
    """
    full = MaskRule(BandRule())
    if not decode:
        require(sparse_mode in INFER_SPARSE_MODES, "sparse_mode",
                f"one of {list(INFER_SPARSE_MODES)} (5-8 are not supported by FusedInferAttentionScore)", sparse_mode)
    if atten_mask is None:
        require(decode or sparse_mode == 0, "atten_mask", f"a mask for sparse_mode {sparse_mode}", None,
                "modes 2-4 take torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)")
        return full
    check_tensor("atten_mask", atten_mask, ndim=(2, 3, 4), dtypes=INFER_MASK_DTYPES)
    if decode or sparse_mode in (0, 1):
        explicit = _infer_mask_view(atten_mask, decode=decode, batch=batch, rows=rows, cols=cols)
        plain = decode or sparse_mode == 1 or left_padding
        return MaskRule(BandRule() if plain else band_rule(0, pre_tokens, next_tokens), explicit=explicit)
    _check_compressed(atten_mask, 2048, sparse_mode)
    return MaskRule(band_rule(sparse_mode, pre_tokens, next_tokens))  # 2, 3, 4: as training FlashAttention


def build_infer_mask_spec(*, sparse_mode: int, atten_mask: torch.Tensor | None, pre_tokens: int, next_tokens: int,
                          seq: SeqInfo, decode: bool, rows: int, cols: int, q_offsets=None, kv_offsets=None,
                          left_padding: bool = False) -> MaskSpec:
    """Convert a FusedInferAttentionScore mask (:func:`check_infer_mask`) into a :class:`MaskSpec`.

    ``seq`` holds the actual query lengths and the effective KV lengths (shared prefix included), so the
    bottom-right modes 3/4 use ``delta_b = Skv_b + prefix - Sq_b``. ``q_offsets``/``kv_offsets`` are the
    left-padding starts at which each batch reads the mask.
    """
    nb = seq.batch
    rule = check_infer_mask(sparse_mode=sparse_mode, atten_mask=atten_mask, pre_tokens=pre_tokens,
                            next_tokens=next_tokens, batch=nb, decode=decode, rows=rows, cols=cols,
                            left_padding=left_padding)
    lo, hi = rule.band.bands(seq.q_lens, seq.kv_lens)
    if rule.explicit is None:
        return MaskSpec(lo, hi)
    zeros = (0,) * nb
    q_offsets, kv_offsets = tuple(q_offsets or zeros), tuple(kv_offsets or zeros)
    m = rule.explicit if rule.explicit.dtype == torch.bool else rule.explicit != 0
    if any(q_offsets) or any(kv_offsets):
        m = batch_windows(m, q_offsets, kv_offsets, seq, True)
    return _with_explicit(lo, hi, m, seq, atten_mask, ("infer", decode, rows, cols, q_offsets, kv_offsets))


TOKENS_UNBOUNDED = 2147483647  # CANN's "no limit" for pre_tokens / next_tokens


def compressed_causal_mask(device: torch.device) -> torch.Tensor:
    """The canonical compressed 2048x2048 causal mask on ``device``: one shared, never-written tensor per device,
    built there (no upload) and known to be canonical, so its content is never checked. Under ``torch.compile`` it is
    built in the graph (a cached tensor cannot be traced)."""
    if torch.compiler.is_compiling():
        return torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(1)
    return _shared_compressed_causal_mask(device)


@functools.lru_cache(maxsize=8)
def _shared_compressed_causal_mask(device: torch.device) -> torch.Tensor:
    mask = torch.ones(2048, 2048, dtype=torch.bool, device=device).triu_(1)
    _KNOWN_CANONICAL[id(mask)] = weakref.ref(mask)
    return mask


def window_sparse_args(causal: Any, window_size: Any, *, sparse_mode: int, atten_mask, pre_tokens: int,
                       next_tokens: int, device: torch.device) -> dict | None:
    """flash-attn's ``causal`` / ``window_size=(left, right)`` as the sparse-mode arguments they equal, or None
    when neither is used.

    Both are bottom-right aligned as in flash-attn: keep ``(i, j)`` iff
    ``i + Skv - Sq - left <= j <= i + Skv - Sq + right`` (-1: unbounded; ``causal`` sets ``right = 0``), which is
    sparse_mode 3 (causal alone) or 4 with ``pre_tokens=left``, ``next_tokens=right``. They cannot be combined
    with ``sparse_mode``, ``atten_mask``, ``pre_tokens`` or ``next_tokens`` (one way to say the mask).
    """
    if causal is False and window_size == (-1, -1):
        return None  # the defaults: neither is used
    require(isinstance(causal, bool), "causal", "a bool", causal)
    ok = (isinstance(window_size, (tuple, list)) and len(window_size) == 2
          and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size))
    require(ok, "window_size", "a pair (left, right) of ints >= -1 (-1: unbounded)", window_size)
    left, right = window_size
    if not causal and left == right == -1:
        return None
    given = [name for name, used in (("sparse_mode", sparse_mode != 0), ("atten_mask", atten_mask is not None),
                                     ("pre_tokens", pre_tokens != TOKENS_UNBOUNDED),
                                     ("next_tokens", next_tokens != TOKENS_UNBOUNDED)) if used]
    require(not given, "causal", "causal/window_size alone (they replace sparse_mode, atten_mask, pre_tokens and "
            "next_tokens)", Described(f"causal={causal!r}, window_size={tuple(window_size)} with {', '.join(given)}"))
    mask = compressed_causal_mask(device if isinstance(device, torch.device) else torch.device(device))
    if causal:
        right = 0  # as flash-attn: causal is the window's right edge on the diagonal
        if left == -1:
            return dict(sparse_mode=3, atten_mask=mask, pre_tokens=TOKENS_UNBOUNDED, next_tokens=TOKENS_UNBOUNDED)
    return dict(sparse_mode=4, atten_mask=mask, pre_tokens=TOKENS_UNBOUNDED if left == -1 else left,
                next_tokens=TOKENS_UNBOUNDED if right == -1 else right)


def require_mask_for_mode(sparse_mode: Any, atten_mask) -> None:
    """Pythonic API: sparse modes 2-8 without ``atten_mask`` would silently compute full attention (CANN ignores
    the mode then); refuse them and name the flash-attn style options that need no mask."""
    if atten_mask is None and isinstance(sparse_mode, int) and 2 <= sparse_mode <= 8:
        fail("atten_mask", f"a mask for sparse_mode {sparse_mode} (without one CANN computes full attention)", None,
             "Pass causal=True / window_size=(left, right) instead of sparse_mode, or the compressed "
             "torch.ones(2048, 2048, dtype=torch.bool).triu(1) mask (3072 rows with the prefix rectangle for mode 6; "
             "the full mask for mode 5)")
