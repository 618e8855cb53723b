"""The NSA layer's body (``native_sparse_attention``; its entry and custom op: :mod:`.layer_op`), composed from the NSA
attention engine (:mod:`.window`).

The operators keep the NPU's constraints (every KV length a multiple of ``select_block_size`` and at least
``select_block_size * select_block_count``, indices inside the sequence); this layer accepts any sequence length
by padding each sequence's keys/values with zeros up to ``K * select_block_size`` tokens, ``K`` at least one block
past the sequence's last (partial) block. The padding is never visible to a real query: compressed blocks that end
after the query are masked, selected positions after the query are masked (causal), and the unused slots (``-1``) of
given ``block_indices`` select nothing (on the CPU, whose operator validates indices, they point at the first
padding block, wholly after every query of the sequence).

The host work per call is the geometry of the lengths (memoized per length set) and a handful of tensor ops: the
masks are slices of device masks kept per configuration, the top-k of the compressed branch feeds the selection
branch as it is (blocks after a token's own block hold only future keys: the causal rule hides them), and the gated
sum is one batched product. Nothing is read back from the device.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from ..._core.checks import Described, caller_names, check_int, check_tensor, fail, require
from ..._core.indices import PAD, check_index_rows, validation_enabled
from ..._core.varlen import lengths_from_cumulative
from .api import _cumulative, nsa_compress, nsa_compress_attention, nsa_selected_attention
from .compress import compress_block_count
from .window import window_attention

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

COMPRESS_MODES = ("weighted", "mean")


@dataclass(frozen=True)
class _Geometry:
    """The host arithmetic of one length set: per-sequence lengths, starts and padded KV lengths (a multiple of the
    selection block), their cumulative forms and the compressed / selection sizes."""

    lengths: tuple[int, ...]
    starts: tuple[int, ...]
    padded: tuple[int, ...]
    padded_cum: tuple[int, ...]
    cmp_cum: tuple[int, ...]

    @property
    def uniform(self) -> bool:
        """Every sequence has the same length (a ``[B, S]`` view of the packed tokens pads them at once)."""
        return len(set(self.lengths)) <= 1


@functools.lru_cache(maxsize=256)
def _geometry(cum: tuple[int, ...], t: int, select_block: int, slots: int, block: int, stride: int) -> _Geometry:
    lengths = lengths_from_cumulative("actual_seq_len", list(cum), t)
    require(sum(lengths) == t, "cu_seqlens", f"sequences covering all T={t} tokens", list(cum))
    padded = tuple(max(-(-n // select_block) + 1, slots) * select_block for n in lengths)
    cmp_lens = [compress_block_count(p, block, stride) for p in padded]
    return _Geometry(tuple(lengths), tuple(accumulate(lengths, initial=0))[:-1], padded, tuple(accumulate(padded)),
                     tuple(accumulate(cmp_lens)))


def _pad_kv(x: Tensor, geo: _Geometry) -> Tensor:
    """``[T, N, D] -> [sum(padded), N, D]``: each sequence followed by zeros up to its padded length."""
    if geo.uniform and geo.lengths:
        b, n = len(geo.lengths), geo.lengths[0]
        return torch.nn.functional.pad(x.unflatten(0, (b, n)), (0, 0, 0, 0, 0, geo.padded[0] - n)).flatten(0, 1)
    zeros = x.new_zeros(max(p - n for p, n in zip(geo.padded, geo.lengths)), *x.shape[1:])
    parts = []
    for s, n, p in zip(geo.starts, geo.lengths, geo.padded):
        parts += [x[s:s + n], zeros[:p - n]]
    return torch.cat(parts)


def block_of(positions: Tensor, size: int) -> Tensor:
    """``positions // size`` for non-negative positions, as a truncating division (one op; the flooring one is
    several when decomposed, as on ``meta`` tensors)."""
    return torch.div(positions, size, rounding_mode="trunc")


def unused_future_blocks(topk: Tensor, positions: Tensor, select_block: int) -> Tensor:
    """``topk [T, N2, S]`` (its dtype) with ``-1`` (unused) for the blocks after the token's own block: they hold no
    visible compressed key (score 0) and come last in the top-k order, so the ``-1`` slots are trailing."""
    return topk.masked_fill(topk > block_of(positions, select_block).view(-1, 1, 1), -1)


def _split_gates(gates, g_cmp, g_slc, g_swa, t: int, n1: int, dtype) -> list[Tensor | None]:
    """Three ``[T, N1]`` gates (or None: branch off) from ``gates [T, N1, 3]`` or the keyword tensors."""
    if gates is not None:
        require(g_cmp is None and g_slc is None and g_swa is None, "gates",
                "either gates [..., 3] or g_cmp/g_slc/g_swa, not both", Described("both"))
        check_tensor("gates", gates, shape=(t, n1, 3))
        return [gates[..., i].to(dtype) for i in range(3)]
    out = []
    for name, g in (("g_cmp", g_cmp), ("g_slc", g_slc), ("g_swa", g_swa)):
        if g is not None:
            check_tensor(name, g, shape=(t, n1))
            g = g.to(dtype)
        out.append(g)
    return out


def compress_weights(compress: str, wk, wv, block: int, n2: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """The compression weights ``[block, N2]`` of ``compress`` mode (``mean``: ``1/block``, like ``like``)."""
    require(compress in COMPRESS_MODES, "compress", f"one of {COMPRESS_MODES}", compress)
    if compress == "mean":
        require(wk is None and wv is None, "compress_weight_k", "None with compress='mean'", wk if wk is not None
                else wv)
        w = like.new_full((block, n2), 1.0 / block)
        return w, w
    for name, w in (("compress_weight_k", wk), ("compress_weight_v", wv)):
        if w is None:
            fail(name, f"a [compress_block_size={block}, N2={n2}] tensor with compress='weighted'", None)
    return wk, wv


def _positions(geo: _Geometry) -> Tensor:
    """CPU int64 ``[T]``: each token's position in its sequence."""
    lengths = torch.tensor(geo.lengths)
    return torch.arange(int(lengths.sum())) - torch.tensor(geo.starts).repeat_interleave(lengths)


def _check_block_indices(idx: Tensor, t: int, n2: int, geo: _Geometry, select_block: int) -> Tensor:
    """``block_indices [T, N2, S]`` as int64: -1 or a block at or before the token's own block (values validated
    where :func:`~attnops._core.indices.validation_enabled` says so; unvalidated, a value outside the sequence's
    blocks selects nothing, one after the token's block only keys the causal rule hides)."""
    check_tensor("block_indices", idx, ndim=3, dtypes=(torch.int32, torch.int64))
    require(idx.shape[0] == t and idx.shape[1] == n2, "block_indices", f"[T={t}, N2={n2}, S]", idx)
    if validation_enabled(idx.device):
        own = (_positions(geo) // select_block).view(-1, 1)
        check_index_rows("block_indices", idx, idx != PAD, own + 1, what="the blocks up to the token's own")
    return idx.long()


def _limit_counts(idx: Tensor, block_counts, t: int, n2: int) -> Tensor:
    """Slots at or after the token's ``block_counts`` become -1."""
    if block_counts is None:
        return idx
    if isinstance(block_counts, Tensor):
        check_tensor("block_counts", block_counts, shape=(t, n2))
        counts = block_counts.long().unsqueeze(-1)
    else:
        counts = check_int("block_counts", block_counts, lo=0)
    slot = torch.arange(idx.shape[-1], device=idx.device)
    return torch.where(slot < counts, idx, torch.full_like(idx, -1))


def _unused_slots(idx: Tensor, geo: _Geometry, select_block: int) -> Tensor:
    """``idx`` as int32 for the selected attention: on the CPU (whose operator validates indices) a ``-1`` slot
    points at the sequence's first padding block (wholly after its tokens: it selects nothing); on another device
    the kernels skip it."""
    if idx.device.type == "cpu":
        pad = torch.tensor([-(-n // select_block) for n in geo.lengths]).repeat_interleave(torch.tensor(geo.lengths))
        idx = torch.where(idx < 0, pad.view(-1, 1, 1), idx)
    return idx.to(torch.int32)


def gated_sum(outs: dict[int, Tensor], gate: list[Tensor | None], gates: Tensor | None = None) -> Tensor:
    """``sum_i gate[i][..., None] * outs[i]`` over the branches that are on (``i``: 0 compression, 1 selection,
    2 window; ``gate[i] [T, N1]``, ``outs[i] [T, N1, Dv]``): on a GPU one batched product of the gates ``[T*N1, 1,
    k]`` (``gates [T, N1, 3]`` itself when all three are on and it has their dtype) with the outputs copied into one
    ``[T*N1, k, Dv]`` buffer; elementwise on the CPU (where low-precision batched products are slow)."""
    order = sorted(outs)
    if len(order) == 1 or outs[order[0]].device.type == "cpu":
        total = gate[order[0]].unsqueeze(-1) * outs[order[0]]
        for i in order[1:]:
            total = total + gate[i].unsqueeze(-1) * outs[i]
        return total
    return batched_gated_sum(outs, gate, gates)


def batched_gated_sum(outs: dict[int, Tensor], gate: list[Tensor | None], gates: Tensor | None = None) -> Tensor:
    """:func:`gated_sum` as one batched product (its GPU form)."""
    order = sorted(outs)
    whole = gates is not None and order == [0, 1, 2] and gates.dtype == outs[0].dtype
    weights = gates if whole else _stacked([gate[i] for i in order], -1)
    values = _stacked([outs[i] for i in order], -2)
    shape = values.shape
    return torch.bmm(weights.reshape(-1, 1, len(order)), values.view(-1, len(order), shape[-1])).view(
        *shape[:-2], shape[-1])


def _stacked(tensors: list[Tensor], dim: int) -> Tensor:
    """``torch.stack(tensors, dim)`` (``dim`` negative) as copies into one buffer (fewer dispatched ops than
    ``stack``'s ``cat``)."""
    first = tensors[0]
    shape = list(first.shape)
    shape.insert(len(shape) + 1 + dim, len(tensors))
    out = torch.empty(shape, dtype=first.dtype, device=first.device)
    for i, t in enumerate(tensors):
        out.select(dim, i).copy_(t)
    return out


def _to_packed(layout: str, query: Tensor, cu_seqlens, actual_seq_len):
    require(layout in ("TND", "BSND"), "layout", "'TND' or 'BSND'", layout)
    if layout == "TND":
        check_tensor("query", query, ndim=3)
        return _cumulative("cu_seqlens", cu_seqlens, actual_seq_len, query.shape[0])
    check_tensor("query", query, ndim=4)
    require(cu_seqlens is None and actual_seq_len is None, "cu_seqlens", "None with layout='BSND'", cu_seqlens)
    b, s = query.shape[:2]
    return [s * (i + 1) for i in range(b)]


def _flat(x, layout: str):
    return x if x is None or layout == "TND" or not isinstance(x, Tensor) else x.flatten(0, 1)


def _native_sparse_attention(query, key, value, gates, compress_weight_k, compress_weight_v, *, g_cmp, g_slc,
                             g_swa, cu_seqlens, actual_seq_len, layout, compress_block_size, compress_stride,
                             select_block_size, select_block_count, window_size, local_blocks, block_indices,
                             block_counts, compress, scale) -> Tensor:
    """:func:`native_sparse_attention` on inputs of one device, autocast off."""
    batch_shape = query.shape[:2] if layout == "BSND" else query.shape[:1]
    cum = _to_packed(layout, query, cu_seqlens, actual_seq_len)
    query, key, value = (_flat(x, layout) for x in (query, key, value))
    gates, g_cmp, g_slc, g_swa, block_indices, block_counts = (
        _flat(x, layout) for x in (gates, g_cmp, g_slc, g_swa, block_indices, block_counts))
    check_tensor("key", key, ndim=3)
    t, n1, n2 = query.shape[0], query.shape[1], key.shape[1]
    window = check_int("window_size", window_size, lo=0)
    ls = check_int("select_block_size", select_block_size, lo=1)
    count = check_int("select_block_count", select_block_count, lo=1)
    slots = block_indices.shape[-1] if block_indices is not None else count
    # under torch.compile the cache wrapper is bypassed (Dynamo traces the function once per graph anyway)
    geometry = _geometry.__wrapped__ if torch.compiler.is_compiling() else _geometry
    geo = geometry(tuple(cum), t, ls, slots, compress_block_size, compress_stride)
    gate = _split_gates(gates, g_cmp, g_slc, g_swa, t, n1, value.dtype)
    require(any(g is not None for g in gate), "gates", "at least one branch gate", Described("none"))
    shape = (t, n1, value.shape[2])
    outs = {}  # the outputs of the branches that are on, by gate column

    def output() -> Tensor:
        return _output(outs, gate, gates, shape, value, batch_shape)
    if gate[2] is not None and window > 0:
        outs[2] = window_attention(query, key, value, list(cum), window, scale)
    need_cmp = gate[0] is not None or (gate[1] is not None and block_indices is None)
    if not need_cmp and gate[1] is None:
        return output()
    k_pad, v_pad = _pad_kv(key, geo), _pad_kv(value, geo)
    topk = None
    if need_cmp:
        wk, wv = compress_weights(compress, compress_weight_k, compress_weight_v, compress_block_size, n2, key)
        with caller_names(input="key", weight="compress_weight_k"):
            k_cmp = nsa_compress(k_pad, wk, block_size=compress_block_size, stride=compress_stride,
                                 actual_seq_len=list(geo.padded_cum))
        with caller_names(input="value", weight="compress_weight_v"):
            v_cmp = nsa_compress(v_pad, wv, block_size=compress_block_size, stride=compress_stride,
                                 actual_seq_len=list(geo.padded_cum))
        o_cmp, topk, _, _ = nsa_compress_attention(
            query, k_cmp, v_cmp, compress_block_size=compress_block_size, compress_stride=compress_stride,
            select_block_size=ls, select_block_count=count, scale=scale, causal=True,
            local_blocks=local_blocks,
            actual_seq_qlen=cum, actual_cmp_seq_kvlen=list(geo.cmp_cum))
        if gate[0] is not None:
            outs[0] = o_cmp
    if gate[1] is None:
        return output()
    if block_indices is None:
        idx = topk  # blocks after a token's own block only hold keys the causal rule hides
    else:
        idx = _check_block_indices(block_indices, t, n2, geo, ls)
    if block_counts is not None or block_indices is not None:
        idx = _unused_slots(_limit_counts(idx.long(), block_counts, t, n2), geo, ls)
    outs[1] = nsa_selected_attention(query, k_pad, v_pad, idx, select_block_size=ls, causal=True, scale=scale,
                                     actual_seq_qlen=cum, actual_seq_kvlen=list(geo.padded_cum))
    return output()


def _output(outs: dict[int, Tensor], gate: list, gates: Tensor | None, shape, like: Tensor, batch_shape) -> Tensor:
    """The gated sum of the branches (zeros of ``shape`` when none is on) in the input's batch shape."""
    out = gated_sum(outs, gate, gates) if outs else like.new_zeros(shape)
    return out.unflatten(0, batch_shape)
