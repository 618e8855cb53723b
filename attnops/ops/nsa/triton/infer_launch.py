"""Host side of the NSA compressed-attention and decode kernels: plans (allocated outputs and launches, run on the
NSA kernel family of ``family.py``) and the device steps around them.

Compressed attention is the FlashAttention forward kernel (output and statistics), then ``importance_kernel``
(block scores ``[T, N2, maxSel]`` from the final statistics, the ``[T, N1, CmpS]`` probabilities never stored;
forced blocks (``topk_mask`` or the ``local_blocks`` rule) at ``FLT_MAX``, blocks past a batch's selection length at
-inf), then ``topk_kernel``: the ``count`` best blocks per row, ties to the lower index (the reference's stable
descending sort).

Decode (one query token per request, paged caches): ``selected_decode_kernel`` per (request, KV head, split of the
selected slots; :func:`selected_decode_splits`), merged in split order by ``decode_merge_kernel``, and the
compressed decode, split over the compressed keys for small batches (FlashDecoding,
:func:`decode_splits`): ``compress_decode_kernel`` per (request, KV head, split), then ``compress_decode_score_kernel``
per (request x score tile, KV head) merges the splits in a fixed order; the decode top-k rule (first and last two
blocks forced, then the best others) is the score kernel's scores (forced blocks at ``FLT_MAX``) through
``topk_kernel``; compression into the cache is
``compress_cache_kernel``. Per-request lengths are a host list (staged to the device
without a synchronisation) or a device tensor the kernels read; no plan reads a device value on the host.
"""
from __future__ import annotations

import math

import torch

from ...._core import staging
from ...._core.triton.launch import Launch, cdiv, pow2, unit_last_stride
from ...._core.triton.support import interpreting
from ...common.triton import launch as fa_launch
from ...common.triton import launch_args as fa_args
from ..compress_attention import CompressAttentionSpec
from ..decode import CompressSelection
from ..paged_kv import PagedKV
from .family import KERNELS, SCORE_BLOCK_K, importance_tiles, pair_grid, precision_flags


def _top_k(scores: torch.Tensor, count: int) -> tuple[torch.Tensor, Launch]:
    """``(indices [rows..., count] int32, launch)``: ``topk_kernel`` over the last axis of fp32 ``scores``."""
    out = torch.empty((*scores.shape[:-1], count), dtype=torch.int32, device=scores.device)
    rows = math.prod(scores.shape[:-1])
    return out, Launch("topk_kernel", (rows,), (scores, out, scores.shape[-1], count, scores.shape[-1], count), {})


def importance_plan(spec: CompressAttentionSpec, query, key, softmax_max, softmax_sum, interpret: bool):
    """``((scores [T, N2, maxSel] fp32, topk_indices [T, N2, count] int32), launches)``: the group-summed block
    scores (forced blocks at ``FLT_MAX``, -inf past each batch's blocks) and their top-k (0 on tokens past the
    batches, as the reference)."""
    fa, device = spec.fa, query.device
    g, seq = fa.geom, fa.seq
    sel_max = max(spec.sel_lens, default=0)
    scores = torch.full((fa.total_q, g.n2, sel_max), float("-inf"), dtype=torch.float32, device=device)
    topk, topk_launch = _top_k(scores, spec.select_count)
    if fa.total_q == 0:
        return (scores, topk), []
    if sel_max == 0:
        return (scores, topk), [topk_launch]
    qv, kv = fa_args.token_view(query, fa, g.n1), fa_args.token_view(key, fa, g.n2)

    def build() -> tuple:
        dummy = torch.empty(1, dtype=torch.uint8, device=device)
        mask, mask_flags = fa_args.mask_args(fa, device, dummy)
        forced = dummy if spec.topk_mask is None else unit_last_stride(spec.topk_mask).view(torch.uint8)
        sel = staging.cached_upload(("nsa.sel_lens", spec.sel_lens), lambda: list(spec.sel_lens), torch.int64, device)
        sel_tiles = cdiv(sel_max, SCORE_BLOCK_K)
        row_blocks = cdiv(seq.max_q, importance_tiles(query.dtype, interpret)[0])
        grid, bh_fold, fold = pair_grid(row_blocks * sel_tiles, seq.batch, g.n2)
        return grid, (fa_args.batch_meta(fa, device), sel, qv.stride(0), qv.stride(1), kv.stride(0), kv.stride(1),
                      fa_args.stats_geometry(fa)[2], scores.stride(0), scores.stride(1), *mask, forced,
                      forced.stride(0) if forced.dim() == 2 else 0, spec.local_blocks or 0, spec.position_offset,
                      spec.select_block, fa.scale, g.n2, g.group, g.d, spec.m, spec.nn, sel_tiles, seq.batch,
                      bh_fold), dict(BLOCK_D=pow2(g.d), **precision_flags(query.dtype, interpret), **mask_flags,
                                     FORCED=_forced_kind(spec), **fold)

    # the launch but for the call's own tensors, once per spec (memoized per call configuration) and strides
    plan_key = (interpret, qv.stride(), kv.stride())
    if plan_key not in spec.plans:
        spec.plans[plan_key] = build()
    grid, rest, kwargs = spec.plans[plan_key]
    launch = Launch("importance_kernel", grid, (qv, kv, softmax_max, softmax_sum, scores, *rest), kwargs)
    return (scores, topk), [launch, topk_launch]


def _forced_kind(spec: CompressAttentionSpec) -> int:
    """``FORCED`` of ``importance_kernel``: 0 none, 1 a ``topk_mask`` tensor, 2 the ``local_blocks`` rule."""
    return 2 if spec.local_blocks is not None else 0 if spec.topk_mask is None else 1


def compress_attention(spec: CompressAttentionSpec, query, key, value):
    """``(attention_out, topk_indices, softmax_max, softmax_sum)`` of ``nsa_compress_attention`` on the kernels."""
    out, smax, ssum = fa_launch.forward(spec.fa, query, key, value)
    (_, topk), launches = importance_plan(spec, query, key, smax, ssum, interpreting(query.device))
    KERNELS.run_all(launches, query.device)
    return out, topk, smax, ssum


DECODE_PROGRAMS = 2 * 132  # compressed decode: programs for two waves of an H100's 132 SMs
SPLIT_KEYS = 16  # compressed decode: a split's keys are a multiple of this (a key tile of fp32 and the interpreter)


def decode_splits(batch: int, n2: int, keys: int) -> tuple[int, int]:
    """``(splits, chunk)`` of the compressed decode over (at most) ``keys`` compressed keys per request: ``chunk``
    keys per split, a multiple of ``SPLIT_KEYS`` rounded down so that ``batch x n2 x splits >= DECODE_PROGRAMS``
    where the keys allow, and no split past the last key. From shapes and host lengths only; the same chunk (and
    so the same bits) whether the lengths are a host list or bounded by the block table, as long as both bounds
    give it (always for contexts under ``SPLIT_KEYS x DECODE_PROGRAMS / (batch x n2)`` keys)."""
    want = cdiv(DECODE_PROGRAMS, max(batch * n2, 1))
    chunk = max(keys // want // SPLIT_KEYS * SPLIT_KEYS, SPLIT_KEYS)
    return max(cdiv(keys, chunk), 1), chunk


def _decode_flags(kv: PagedKV, query: torch.Tensor, interpret: bool) -> dict:
    return dict(BLOCK_G=pow2(kv.n1 // kv.n2), BLOCK_D=pow2(query.shape[-1]), BLOCK_DV=pow2(kv.dv),
                **precision_flags(query.dtype, interpret))


def _cache_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    return cache.stride(0), cache.stride(1), cache.stride(2)


def _lengths(kv: PagedKV, lens: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The per-request lengths on the device: ``lens`` as given, or the host list staged (pinned, non-blocking)."""
    return lens if lens is not None else staging.upload(list(kv.kv_lens), torch.int64, device)


def selected_decode_splits(batch: int, n2: int, count: int) -> tuple[int, int]:
    """``(splits, chunk)`` of the selected decode: ``chunk`` slots per split, enough splits for ``batch x n2 x
    splits >= DECODE_PROGRAMS`` where the ``count`` slots allow (shapes only: the same bits at every length)."""
    splits = max(min(count, cdiv(DECODE_PROGRAMS, max(batch * n2, 1))), 1)
    chunk = max(cdiv(count, splits), 1)
    return max(cdiv(count, chunk), 1), chunk


def selected_decode_plan(kv: PagedKV, block: int, query, key, value, topk_indices, block_table, interpret: bool,
                         lens: torch.Tensor | None = None):
    """``(attention_out [B, N1, Dv], launches)`` of ``nsa_selected_attention_infer``: ``selected_decode_kernel``
    over :func:`selected_decode_splits` of the selected slots (partials in fp32 workspaces), merged in split order
    by ``decode_merge_kernel`` when there is more than one split."""
    device = query.device
    out = torch.empty(kv.batch, kv.n1, kv.dv, dtype=query.dtype, device=device)
    if kv.batch == 0:
        return out, []
    q, k, v = (unit_last_stride(t) for t in (query, key, value))
    topk, table = topk_indices.contiguous(), block_table.contiguous()
    flags = _decode_flags(kv, query, interpret)
    splits, chunk = selected_decode_splits(kv.batch, kv.n2, topk.shape[-1])
    rows, dv_tile = flags["BLOCK_G"], flags["BLOCK_DV"]
    parts = kv.batch * kv.n2 * splits if splits > 1 else 0
    stats = torch.empty(parts * 2 * rows, dtype=torch.float32, device=device)
    partial = torch.empty(parts * rows * dv_tile, dtype=torch.float32, device=device)
    launches = [Launch("selected_decode_kernel", (kv.batch, kv.n2, splits),
                       (q, k, v, out, stats, partial, topk, table, _lengths(kv, lens, device), q.stride(0),
                        q.stride(1), *_cache_strides(k), *_cache_strides(v), out.stride(0), out.stride(1),
                        topk.stride(0), topk.stride(1), table.stride(0), kv.scale, kv.n2, kv.n1 // kv.n2,
                        query.shape[-1], kv.dv, key.shape[1], key.shape[0], kv.capacity, block, topk.shape[-1],
                        chunk),
                       dict(flags, SPLIT=splits > 1))]
    if splits > 1:
        launches.append(Launch("decode_merge_kernel", (kv.batch, kv.n2),
                               (out, stats, partial, out.stride(0), out.stride(1), kv.n2, kv.n1 // kv.n2, kv.dv,
                                splits),
                               dict(BLOCK_G=rows, BLOCK_DV=dv_tile)))
    return out, launches


def selected_decode(kv: PagedKV, block: int, query, key, value, topk_indices, block_table, lens=None):
    out, launches = selected_decode_plan(kv, block, query, key, value, topk_indices, block_table,
                                         interpreting(query.device), lens)
    KERNELS.run_all(launches, query.device)
    return out


def compress_decode_plan(kv: PagedKV, sel: CompressSelection, query, key, value, block_table, interpret: bool,
                         lens: torch.Tensor | None = None):
    """``((attention_out [B, N1, Dv], topk_indices [B, N2, count] int32), launches)`` of
    ``nsa_compress_attention_infer``: ``compress_decode_kernel`` over :func:`decode_splits` of the compressed keys
    (partials in fp32 workspaces), ``compress_decode_score_kernel`` (merged output and the block scores
    ``[B, N2, maxBlocks]``: the first and last two blocks at ``FLT_MAX``, -inf past each request's blocks;
    ``maxBlocks`` and the split count from the host lengths, or from the block table's capacity for device
    lengths), then their top-k."""
    device = query.device
    out = torch.empty(kv.batch, kv.n1, kv.dv, dtype=query.dtype, device=device)
    longest = max(kv.kv_lens, default=0) if kv.kv_lens is not None else kv.capacity
    width = sel.blocks(longest) if kv.batch else 0
    scores = torch.empty((kv.batch, kv.n2, width), dtype=torch.float32, device=device)
    topk, topk_launch = _top_k(scores, sel.count)
    if kv.batch == 0:
        return (out, topk), []
    q, k, v = (unit_last_stride(t) for t in (query, key, value))
    table = block_table.contiguous()
    flags = _decode_flags(kv, query, interpret)
    splits, chunk = decode_splits(kv.batch, kv.n2, longest)
    rows, dv_tile = flags["BLOCK_G"], flags["BLOCK_DV"]
    stats = torch.empty(kv.batch * kv.n2 * splits * 2 * rows, dtype=torch.float32, device=device)
    partial = torch.empty(kv.batch * kv.n2 * splits * rows * dv_tile, dtype=torch.float32, device=device)
    lengths = _lengths(kv, lens, device)
    geometry = (kv.scale, kv.n2, kv.n1 // kv.n2, query.shape[-1], kv.dv, key.shape[1], key.shape[0], kv.capacity)
    attend = Launch("compress_decode_kernel", (kv.batch, kv.n2, splits),
                    (q, k, v, stats, partial, table, lengths, q.stride(0), q.stride(1), *_cache_strides(k),
                     *_cache_strides(v), table.stride(0), *geometry, chunk), flags)
    score = Launch("compress_decode_score_kernel", (kv.batch * max(cdiv(width, SCORE_BLOCK_K), 1), kv.n2),
                   (q, k, out, scores, stats, partial, table, lengths, q.stride(0), q.stride(1), *_cache_strides(k),
                    out.stride(0), out.stride(1), scores.stride(0), scores.stride(1), table.stride(0), *geometry,
                    splits, sel.select_block // sel.stride, sel.block // sel.stride, sel.stride, sel.block,
                    sel.select_block, width), flags)
    return (out, topk), [attend, score, topk_launch]


def compress_decode(kv: PagedKV, sel: CompressSelection, query, key, value, block_table, lens=None):
    (out, topk), launches = compress_decode_plan(kv, sel, query, key, value, block_table, interpreting(query.device),
                                                 lens)
    KERNELS.run_all(launches, query.device)
    return out, topk


CACHE_TAPS = 16  # compression taps per step of compress_cache_kernel


def compress_cache_plan(input, weight, slot_mapping, block_table, cache, lens: torch.Tensor, block: int,
                        stride: int) -> list[Launch]:
    """The launch of ``compress_cache_kernel``: one program per (request, head); ``lens`` on the device."""
    x, table, slots, w = unit_last_stride(input), block_table.contiguous(), slot_mapping.contiguous(), weight.float()
    return [Launch("compress_cache_kernel", (slots.shape[0], x.shape[2]),
                   (x, w, slots, table, lens, cache, *x.stride()[:3], *w.stride(), table.stride(0),
                    *cache.stride()[:2], slots.shape[0], x.shape[0], table.shape[1] * x.shape[1], cache.shape[0],
                    x.shape[1], x.shape[3], block, stride),
                   dict(BLOCK_D=pow2(x.shape[3]), BLOCK_R=64, BLOCK_T=CACHE_TAPS))]


def compress_into_cache(input, weight, slot_mapping, block_table, cache, lens: list[int] | None, block: int,
                        stride: int, lens_tensor: torch.Tensor | None = None) -> None:
    """``nsa_compress_infer`` on the device, without reading a device value: ``compress_cache_kernel`` (lengths as
    given on the device, or the host list staged without blocking)."""
    if slot_mapping.shape[0] == 0 or input.shape[2] == 0:
        return
    n = lens_tensor if lens_tensor is not None else staging.upload(lens, torch.int64, input.device)
    KERNELS.run_all(compress_cache_plan(input, weight, slot_mapping, block_table, cache, n, block, stride),
                    input.device)
