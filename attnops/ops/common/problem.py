"""Validation of a FlashAttention call and its normal form (:class:`FAProblem`), shared by every dialect and
backend: layouts -> :class:`Geometry` + :class:`SeqInfo`, sparse modes -> :class:`MaskSpec`, pse -> :class:`PseSpec`,
dropout -> :class:`DropoutSpec`. Varlen lengths given as ``cu_seqlens`` tensors on a GPU stay there
(:class:`DeviceSeqLens`, :class:`MaskRule`): the Triton kernels derive the per-batch values on the device.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..._core.checks import Described, check_choice, check_scale, check_tensor, fail, require
from ..._core.dropout import DropoutSpec, build_dropout_spec, check_seed_offset
from ..._core.layouts import Geometry, normalize_layout, parse_geometry
from .npu_rounding import NpuRounding
from ..._core.masks import MaskRule, MaskSpec, build_mask_spec, compressed_mask_key, held_mask_key
from ..._core.pse import PseSpec, build_pse_spec, pse_extents
from ..._core.softmax_stats import SOFTMAX_LAYOUTS
from ..._core.varlen import (DeviceSeqLens, SeqInfo, check_max_seqlen, device_seq_lens, lengths_from_cumulative,
                             seq_info_varlen)

INT_MAX = 2147483647
FA_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # fp64: Pythonic API only
DENSE_SPARSE_MODES = (0, 1, 2, 3, 4, 5, 6)
TND_SPARSE_MODES = (0, 1, 2, 3, 4, 6, 7, 8)


@dataclass(frozen=True, eq=False)
class FAProblem:
    """Everything a backend needs, validated: geometry, sequences, mask, pse, dropout, scale, stats layout.
    ``seq`` is a :class:`DeviceSeqLens` and ``mask`` a :class:`MaskRule` when the lengths are device tensors (the
    Triton path only: the reference gets host lengths). Compared and hashed by identity: :func:`build_problem`
    returns the same object for the same call, and launchers remember what they derive from it in ``plans``."""

    geom: Geometry
    seq: SeqInfo | DeviceSeqLens
    mask: MaskSpec | MaskRule
    pse: PseSpec | None
    dropout: DropoutSpec | None
    scale: float
    softmax_layout: str
    total_q: int  # T of query (TND) or B*Sq
    total_kv: int
    softcap: float = 0.0  # > 0: scores ``softcap * tanh(scale*QK^T / softcap)`` before the pse and the mask
    rounding: NpuRounding | None = None  # precision="npu": the kernels' rounding (None: exact)
    plans: dict = dataclasses.field(default_factory=dict, init=False, repr=False)  # launchers' derived launches

    @property
    def layout(self) -> str:
        return self.geom.layout

    @property
    def device_lengths(self) -> bool:
        """Whether the sequence lengths are device tensors (read by the kernels only)."""
        return isinstance(self.seq, DeviceSeqLens)


CACHE_ENTRIES = 256  # problems remembered by :func:`build_problem` (least recently used dropped first)
_OPTIONS = ("head_num", "layout", "scale", "keep_prob", "pre_tokens", "next_tokens", "prefix", "actual_seq_qlen",
            "actual_seq_kvlen", "sparse_mode", "pse_type", "q_start_idx", "kv_start_idx", "softmax_layout",
            "max_seqlen_q", "max_seqlen_k", "softcap", "pse_bottom_right")
_MODE = _OPTIONS.index("sparse_mode")
_CACHE: OrderedDict[tuple, FAProblem] = OrderedDict()
_PLAIN = frozenset((int, float, str, bool, type(None)))


def _cache_key(query, key, value, pse, atten_mask, drop_mask, cu_seqlens_q, cu_seqlens_k, options: tuple):
    """The facts a call's problem depends on, when no tensor beyond q/k/v contributes more than its shape, dtype and
    device (no pse, drop mask or ``cu_seqlens``; no mask, a compressed one that is not read, or a small device bool
    mask the problem holds as given, by identity: :func:`~attnops._core.masks.held_mask_key`): shapes, dtypes,
    devices and the options with their exact types (lists as tuples). None when the call must be built afresh (also
    when q, k or v is not a tensor: the build names it)."""
    if pse is not None or drop_mask is not None or cu_seqlens_q is not None or cu_seqlens_k is not None:
        return None
    if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        return None  # validated (and refused) afresh
    mask = None
    if atten_mask is not None:
        if not isinstance(atten_mask, torch.Tensor):
            return None
        mask = compressed_mask_key(atten_mask, options[_MODE]) or held_mask_key(atten_mask)
        if mask is None:
            return None
    types = tuple(map(type, options))
    if not _PLAIN.issuperset(types):
        if not all(t in _PLAIN or (t in (list, tuple) and all(type(v) is int for v in o))
                   for t, o in zip(types, options)):
            return None
        options = tuple(tuple(o) if t in (list, tuple) else o for t, o in zip(types, options))
    return (query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype, query.device, key.device,
            value.device, mask, options, types)


def build_problem(query, key, value, *, head_num: int, layout: str, scale: float, pse=None, atten_mask=None,
                  keep_prob: float = 1.0, drop_mask=None, seed: int | None = None, offset: int = 0,
                  pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX, prefix=None, actual_seq_qlen=None,
                  actual_seq_kvlen=None, sparse_mode: int = 0, pse_type: int = 1, q_start_idx=None,
                  kv_start_idx=None, softmax_layout: str = "", cu_seqlens_q=None, cu_seqlens_k=None,
                  max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, softcap: float = 0.0,
                  pse_bottom_right: bool = False) -> FAProblem:
    """Validate a FlashAttention call (forward or backward inputs) and convert it to an :class:`FAProblem`.

    TND lengths are the cumulative ``actual_seq_qlen/kvlen`` lists, or ``cu_seqlens_q/k`` tensors on the query's
    device (:class:`DeviceSeqLens`: their values are not read, so not validated) bounded by ``max_seqlen_q/k``.
    A call whose problem depends on shapes, dtypes, devices and options only (the common training step) reuses the
    problem of the same earlier call: validation runs once per such configuration, the Philox seed and offset are
    the call's own. ``softcap`` > 0 caps the scaled scores (``softcap * tanh(S / softcap)``) before the pse and the
    mask; ``pse_bottom_right`` aligns ALiBi slopes (pse_type 2/3) to the bottom-right corner of each batch's score
    matrix (flash-attn's ``-slope * |i + Skv - Sq - j|``: query positions start at ``Skv - Sq + q_start_idx``)."""
    options = (head_num, layout, scale, keep_prob, pre_tokens, next_tokens, prefix, actual_seq_qlen, actual_seq_kvlen,
               sparse_mode, pse_type, q_start_idx, kv_start_idx, softmax_layout, max_seqlen_q, max_seqlen_k, softcap,
               pse_bottom_right)
    cache_key = _cache_key(query, key, value, pse, atten_mask, drop_mask, cu_seqlens_q, cu_seqlens_k, options)
    p = None if cache_key is None else _CACHE.get(cache_key)
    if p is None:
        p = _build_problem(query, key, value, pse=pse, atten_mask=atten_mask, drop_mask=drop_mask, seed=seed,
                           offset=offset, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                           **dict(zip(_OPTIONS, options)))
        if cache_key is not None:
            _CACHE[cache_key] = p  # a mask keyed by identity is one the problem holds: alive, its identity not reused
            if len(_CACHE) > CACHE_ENTRIES:
                _CACHE.popitem(last=False)
        return p
    try:
        _CACHE.move_to_end(cache_key)
    except KeyError:  # dropped meanwhile by another thread: p stays valid
        pass
    if p.dropout is not None and (p.dropout.seed, p.dropout.offset) != (seed, offset):
        seed, offset = check_seed_offset(seed, offset)
        p = dataclasses.replace(p, dropout=dataclasses.replace(p.dropout, seed=seed, offset=offset))
    return p


def _build_problem(query, key, value, *, head_num, layout, scale, pse, atten_mask, keep_prob, drop_mask, seed, offset,
                   pre_tokens, next_tokens, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, pse_type,
                   q_start_idx, kv_start_idx, softmax_layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, softcap, pse_bottom_right) -> FAProblem:
    layout = normalize_layout("input_layout", layout)
    check_tensor("query", query, dtypes=FA_DTYPES)
    for name, t in (("key", key), ("value", value)):
        check_tensor(name, t)
        if t.dtype != query.dtype:
            fail(name, f"dtype {query.dtype} (same as query)", t)
        require(t.device == query.device, name, f"a tensor on {query.device} like query", t)
    check_scale("scale", scale)
    geom = parse_geometry(query, key, value, head_num, layout)
    check_choice("softmax_layout", softmax_layout, SOFTMAX_LAYOUTS)
    if layout == "TND":
        seq = _varlen(query, key, actual_seq_qlen, actual_seq_kvlen, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                      max_seqlen_k)
        total_q, total_kv = query.shape[0], key.shape[0]
        allowed = TND_SPARSE_MODES
    else:
        require(softmax_layout == "", "softmax_layout", "'' for dense layouts ('TND' is for input_layout TND)",
                softmax_layout)
        for name, v in (("cu_seqlens_q", cu_seqlens_q), ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            require(v is None, name, "None for dense layouts (sequence lengths are for layout 'TND')", v)
        seq = SeqInfo.dense(geom.batch, geom.sq, geom.skv)
        total_q, total_kv = geom.batch * geom.sq, geom.batch * geom.skv
        allowed = DENSE_SPARSE_MODES
    for name, v in (("pre_tokens", pre_tokens), ("next_tokens", next_tokens), ("sparse_mode", sparse_mode)):
        require(isinstance(v, int) and not isinstance(v, bool), name, "an int", v)
    if atten_mask is not None:
        require(atten_mask.device == query.device, "atten_mask", f"a tensor on {query.device} like query",
                atten_mask)
    mask = build_mask_spec(sparse_mode=sparse_mode, atten_mask=atten_mask, pre_tokens=pre_tokens,
                           next_tokens=next_tokens, prefix=prefix, seq=seq, n1=geom.n1, allowed_modes=allowed)
    pse_spec = build_pse_spec(pse, pse_type=pse_type, seq=seq, n1=geom.n1, dtype=query.dtype, mask=mask,
                              sparse_mode=sparse_mode, q_start_idx=q_start_idx, kv_start_idx=kv_start_idx,
                              bottom_right=pse_bottom_right)
    softcap = _check_softcap(softcap, scale, pse_spec)
    if isinstance(seq, DeviceSeqLens):
        if mask.explicit is not None:
            seq = seq.bounded(*mask.explicit.shape[-2:])
        seq = seq.bounded(*pse_extents(pse_spec))
        dropout = build_dropout_spec(keep_prob=keep_prob, drop_mask=drop_mask, seed=seed, offset=offset,
                                     numels=None, block_offsets=[])
    else:
        dropout = build_dropout_spec(keep_prob=keep_prob, drop_mask=drop_mask, seed=seed, offset=offset,
                                     numels=seq.score_numel(geom.n1), block_offsets=seq.score_offsets(geom.n1))
    return FAProblem(geom, seq, mask, pse_spec, dropout, float(scale), softmax_layout, total_q, total_kv, softcap)


def _check_softcap(softcap, scale: float, pse: PseSpec | None) -> float:
    """``softcap`` as a float: 0 (off) or a finite positive cap of the scaled scores, which needs a nonzero scale and
    no pse_type 1 pse (that pse is added before the scale, inside what would be capped)."""
    ok = isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and 0 <= softcap < float("inf")
    require(ok, "softcap", "a finite float >= 0 (0: no capping)", softcap)
    if softcap > 0:
        require(scale != 0, "scale", "a nonzero scale with softcap > 0", scale)
        require(pse is None or not pse.add_before_scale, "pse_type",
                "0, 2 or 3 with softcap > 0 (pse_type 1 adds the pse before the scale, inside the capped scores)",
                pse.pse_type if pse is not None else None)
    return float(softcap)


def _varlen(query, key, actual_seq_qlen, actual_seq_kvlen, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
            ) -> SeqInfo | DeviceSeqLens:
    """TND lengths: host cumulative lists, or ``cu_seqlens`` tensors on the query's device."""
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        require(actual_seq_qlen is None and actual_seq_kvlen is None, "cu_seqlens_q",
                "either cu_seqlens_q/k tensors or actual_seq_qlen/kvlen lists, not both", Described("both"))
        return device_seq_lens(cu_seqlens_q, cu_seqlens_k, query.shape[0], key.shape[0], max_seqlen_q,
                               max_seqlen_k, query.device)
    require(actual_seq_qlen is not None, "actual_seq_qlen", "cumulative query lengths for layout TND", None)
    require(actual_seq_kvlen is not None, "actual_seq_kvlen", "cumulative key/value lengths for layout TND", None)
    q_lens = lengths_from_cumulative("actual_seq_qlen", actual_seq_qlen, query.shape[0])
    kv_lens = lengths_from_cumulative("actual_seq_kvlen", actual_seq_kvlen, key.shape[0])
    seq = seq_info_varlen(q_lens, kv_lens)
    check_max_seqlen("max_seqlen_q", max_seqlen_q, seq.max_q)
    check_max_seqlen("max_seqlen_k", max_seqlen_k, seq.max_kv)
    return seq
