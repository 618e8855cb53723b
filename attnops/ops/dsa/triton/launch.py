"""Host side of the DSA kernels: the layouts as strides, grids and outputs. Each launcher builds a plan
``(outputs, [Launch, ...])`` (also compiled by ``python -m attnops aot``) and runs it on the DSA kernel family.

Nothing is read back from the device: the lengths (``actual_seq_lengths_*``), the block table and the indices are
read by the kernels, so the plans never synchronise and a CUDA graph can capture them; host facts are shapes only.
The kernels write every element of the outputs (padding rows included), which are allocated empty. Arguments are
validated by the operators' API before they get here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...._core import staging
from ...._core.triton.launch import Launch, pow2, unit_last_stride
from ...._core.triton.support import interpreting
from .family import KERNELS, head_tile, precision_flags, split_count, value_tile

KV_MODES = {"BSND": 0, "TND": 1, "PA_BSND": 2}
ROPE_DIM = 64  # rope columns of a packed quantized row
LATENT_DIM = 512  # latent (nope) columns of a packed quantized row
PACKED_ROW = 656  # bytes of a packed quantized row: 512 codes, 64 rope values (2 bytes), 4 fp32 scales


@dataclass(frozen=True)
class Geometry:
    """Where the rows of a DSA call live, as kernel arguments: the query side (packed TND tokens or BSND rows, their
    lengths tensor and its stride, the padded length or token total ``s1``, the batch count) and the key side (mode,
    lengths, ``s2``: padded length, token total or the block table's capacity, the block table and page size)."""

    q_packed: bool
    q_lens: torch.Tensor | None
    s1: int
    n_batch: int
    kv_mode: int
    kv_lens: torch.Tensor | None
    s2: int
    block_table: torch.Tensor | None
    page: int
    n_pages: int

    @property
    def grid_rows(self) -> tuple[int, int]:
        """Programs per head tile: ``(T1, 1)`` packed, ``(S1, B)`` BSND."""
        return (self.s1, 1) if self.q_packed else (self.s1, self.n_batch)

    def length_args(self, device: torch.device, spare: torch.Tensor) -> tuple:
        """The lengths tensors, block table and their strides (``spare`` for an absent pointer)."""
        q_lens, kv_lens, table = (spare if x is None else x.to(device, non_blocking=True)
                                  for x in (self.q_lens, self.kv_lens, self.block_table))
        return (q_lens, kv_lens, table), (_broadcast_stride(self.q_lens), _broadcast_stride(self.kv_lens),
                                          table.stride(0) if self.block_table is not None else 0)

    def constexprs(self, causal: bool) -> dict:
        return dict(Q_PACKED=self.q_packed, Q_LENS=self.q_lens is not None, KV_MODE=self.kv_mode,
                    KV_LENS=self.kv_lens is not None, CAUSAL=causal)


def _broadcast_stride(lens: torch.Tensor | None) -> int:
    """A one-entry lengths tensor applies to every batch (stride 0)."""
    return 0 if lens is None or lens.numel() == 1 else 1


def geometry(query: torch.Tensor, key: torch.Tensor, layout_query: str, layout_kv: str, q_lens, kv_lens,
             block_table) -> Geometry:
    """The :class:`Geometry` of a validated call (``query`` ``[B, S1, N, D]`` / ``[T1, N, D]``, ``key`` in
    ``layout_kv``)."""
    q_packed = layout_query == "TND"
    n_batch = q_lens.numel() if q_packed else query.shape[0]
    mode = KV_MODES[layout_kv]
    page = key.shape[1] if mode == 2 else 1
    s2 = {0: key.shape[1] if key.dim() == 4 else 0, 1: key.shape[0],
          2: block_table.shape[1] * page if block_table is not None else 0}[mode]
    return Geometry(q_packed, q_lens, query.shape[0] if q_packed else query.shape[1], n_batch, mode, kv_lens, s2,
                    block_table if mode == 2 else None, page, key.shape[0] if mode == 2 else 1)


def _token_strides(x: torch.Tensor, packed: bool) -> tuple[int, int, int]:
    """``(batch, token, head)`` strides of a ``[B, S, N, ...]`` (batch stride) or ``[T, N, ...]`` (0) tensor."""
    return (0, x.stride(0), x.stride(1)) if packed else (x.stride(0), x.stride(1), x.stride(2))


def _row_strides(x: torch.Tensor, mode: int) -> tuple[int, int]:
    """``(outer, inner)`` strides of a key-side tensor (:func:`.common.key_rows`' coordinates)."""
    return (0, x.stride(0)) if mode == 1 else (x.stride(0), x.stride(1))


def _idx_strides(x: torch.Tensor, packed: bool) -> tuple[int, int]:
    """``(batch, token)`` strides of a ``[B, S1, 1, K]`` / ``[T1, 1, K]`` tensor."""
    return (0, x.stride(0)) if packed else (x.stride(0), x.stride(1))


# ------------------------------------------------------------------------------------------- lightning indexer
def indexer_plan(g: Geometry, query, key, weights, sparse_count: int, causal: bool, return_value: bool,
                 interpret: bool):
    """``((sparse_indices, sparse_values), launches)``: int32 indices ``[B, S1, 1, K]`` / ``[T1, 1, K]`` and the
    selected scores in the query dtype (an empty ``[0]`` tensor unless ``return_value``)."""
    q, k, w = (unit_last_stride(x) for x in (query, key, weights))
    lead = q.shape[:-2]
    indices = torch.empty((*lead, 1, sparse_count), dtype=torch.int32, device=q.device)
    values = torch.empty((*lead, 1, sparse_count) if return_value else (0,), dtype=q.dtype, device=q.device)
    if indices.numel() == 0:
        return (indices, values), []
    (q_lens, kv_lens, table), lens_strides = g.length_args(q.device, indices)
    heads, d = q.shape[-2], q.shape[-1]
    w_strides = (0, w.stride(0), w.stride(1)) if g.q_packed else (w.stride(0), w.stride(1), w.stride(2))
    launch = Launch("indexer_topk_kernel", g.grid_rows,
                    (q, k, w, indices, values if return_value else indices, q_lens, kv_lens, table,
                     *_token_strides(q, g.q_packed), *_row_strides(k, g.kv_mode), *w_strides,
                     *_idx_strides(indices, g.q_packed), *lens_strides, g.s1, g.s2, g.n_batch, heads, d, g.page,
                     g.n_pages, sparse_count),
                    dict(**g.constexprs(causal), RETURN_VALUE=return_value, BLOCK_H=pow2(heads), BLOCK_D=pow2(d),
                         **precision_flags(q.dtype, interpret)))
    return (indices, values), [launch]


def lightning_indexer(g: Geometry, query, key, weights, sparse_count: int, causal: bool, return_value: bool):
    """Runs :func:`indexer_plan`; returns ``(sparse_indices, sparse_values)``."""
    outputs, launches = indexer_plan(g, query, key, weights, sparse_count, causal, return_value,
                                     interpreting(query.device))
    KERNELS.run_all(launches, query.device)
    return outputs


# ------------------------------------------------------------------------------------------ sparse attention
@dataclass(frozen=True)
class LatentCache:
    """The key side of sparse attention as kernel tensors: the latent rows (codes when quantized), the rope rows,
    the value rows (None: the latent rows), the per-128-column scales (quantized only) and ``quant`` (0 plain,
    1 int8, 2 fp8 e4m3fn)."""

    latent: torch.Tensor
    rope: torch.Tensor | None
    value: torch.Tensor | None
    scales: torch.Tensor | None = None
    quant: int = 0


def plain_cache(key: torch.Tensor, value: torch.Tensor, key_rope: torch.Tensor | None) -> LatentCache:
    """A plain latent cache; the value is read from the key's rows when it is the same data."""
    same = (value.data_ptr() == key.data_ptr() and value.shape == key.shape and value.stride() == key.stride()
            and value.dtype == key.dtype)
    return LatentCache(key, key_rope, None if same else value)


def packed_cache(key: torch.Tensor, query_dtype: torch.dtype) -> LatentCache:
    """Views of a 656-byte packed quantized cache (int8 or fp8 e4m3fn rows): the 512 codes (fp8 as bytes: the kernel
    decodes them), the 64 rope values in the query dtype, the four fp32 scales (no copies)."""
    raw = unit_last_stride(key)
    as_bytes = raw.view(torch.uint8)
    rope = as_bytes[..., LATENT_DIM:LATENT_DIM + 2 * ROPE_DIM].view(query_dtype)
    scales = as_bytes[..., LATENT_DIM + 2 * ROPE_DIM:].view(torch.float32)
    fp8 = key.dtype == torch.float8_e4m3fn
    codes = as_bytes[..., :LATENT_DIM] if fp8 else raw[..., :LATENT_DIM]
    return LatentCache(codes, rope, None, scales, 2 if fp8 else 1)


def attention_plan(g: Geometry, query, query_rope, cache: LatentCache, sparse_indices, scale: float,
                   sparse_block_size: int, causal: bool, return_lse: bool, sinks, interpret: bool):
    """``((attention_out, softmax_max, softmax_sum), launches)``: the output in the query's shape with the value's
    width, fp32 statistics ``[B, 1, S1, N1]`` / ``[1, T1, N1]`` when ``return_lse`` (else empty ``[0]``)."""
    q, idx = unit_last_stride(query), unit_last_stride(sparse_indices)
    qr = None if query_rope is None else unit_last_stride(query_rope)
    k = unit_last_stride(cache.latent)
    v = k if cache.value is None else unit_last_stride(cache.value)
    kr = None if cache.rope is None else unit_last_stride(cache.rope)
    heads, d, dv = q.shape[-2], k.shape[-1], v.shape[-1]
    out = torch.empty((*q.shape[:-1], dv), dtype=q.dtype, device=q.device)
    stat_shape = ((1, q.shape[0], heads) if g.q_packed else (q.shape[0], 1, q.shape[1], heads)) if return_lse else (0,)
    smax, ssum = (torch.empty(stat_shape, dtype=torch.float32, device=q.device) for _ in range(2))
    if out.numel() == 0:
        return (out, smax, ssum), []
    (q_lens, kv_lens, table), lens_strides = g.length_args(q.device, idx)
    rope_d = 0 if kr is None else kr.shape[-1]
    block_h, block_dv = head_tile(heads, q.dtype, interpret), value_tile(dv, interpret)
    rows, batches = g.grid_rows
    tiles = -(-heads // block_h) * -(-dv // block_dv)
    splits = split_count(rows * batches * tiles, idx.shape[-1] * sparse_block_size, interpret)
    spare = smax if return_lse else out
    stats = (smax, ssum) if return_lse else (spare, spare)
    if splits > 1:  # fp32 partials of every (flat row, head, split): accumulators, maxima, sums
        part, pmax, psum = (torch.empty((rows * batches, heads, splits, *w), dtype=torch.float32, device=q.device)
                            for w in ((dv,), (), ()))
    sinks_arg = spare if sinks is None else sinks
    args = (q, q if qr is None else qr, k, k if kr is None else kr, v,
            spare if cache.scales is None else cache.scales, idx, out, *((pmax, psum) if splits > 1 else stats),
            sinks_arg, part if splits > 1 else spare, q_lens, kv_lens, table,
            *_token_strides(q, g.q_packed), *_token_strides(q if qr is None else qr, g.q_packed),
            *_row_strides(k, g.kv_mode), *_row_strides(k if kr is None else kr, g.kv_mode),
            *_row_strides(v, g.kv_mode), *(_row_strides(cache.scales, g.kv_mode) if cache.scales is not None
                                           else (0, 0)),
            *_idx_strides(idx, g.q_packed), *_token_strides(out, g.q_packed), *lens_strides,
            g.s1, g.s2, g.n_batch, heads, d, rope_d, dv, -(-dv // block_dv), splits, g.page, g.n_pages,
            idx.shape[-1], sparse_block_size, float(scale))
    reuse = cache.value is None and not cache.quant and block_dv >= dv  # the value tile is the latent tile
    finish = dict(HAS_SINKS=sinks is not None, RETURN_LSE=return_lse, BLOCK_H=block_h, BLOCK_DV=block_dv)
    launches = [Launch("sparse_attention_kernel", (rows, batches, tiles * splits), args,
                       dict(**g.constexprs(causal), HAS_ROPE=kr is not None, V_IS_K=reuse, QUANT=cache.quant,
                            SPLIT=splits > 1, BLOCK_D=pow2(d), BLOCK_R=pow2(rope_d), **finish,
                            **precision_flags(q.dtype, interpret)))]
    if splits > 1:
        launches.append(Launch("sparse_attention_merge_kernel", (rows * batches, tiles),
                               (pmax, psum, part, out, *stats, sinks_arg, *_token_strides(out, g.q_packed), g.s1,
                                heads, dv, -(-dv // block_dv), splits),
                               dict(Q_PACKED=g.q_packed, **finish)))
    return (out, smax, ssum), launches


def sparse_flash_attention(g: Geometry, query, query_rope, cache: LatentCache, sparse_indices, scale: float,
                           sparse_block_size: int, causal: bool, return_lse: bool, sinks=None):
    """Runs :func:`attention_plan`; returns ``(attention_out, softmax_max, softmax_sum)``."""
    outputs, launches = attention_plan(g, query, query_rope, cache, sparse_indices, scale, sparse_block_size, causal,
                                       return_lse, sinks, interpreting(query.device))
    KERNELS.run_all(launches, query.device)
    return outputs


# ------------------------------------------------------------------- the operators' seam (``ops/dsa/backends.py``)
def geometry_of(call, query: torch.Tensor, key: torch.Tensor) -> Geometry:
    """The :class:`Geometry` of a validated :class:`~attnops.ops.dsa.call.Call`. Device lengths go to the kernels as
    they are (the layouts' own forms: per-batch lengths, cumulative ends). Host lengths come from the call's normal
    form, uploaded once per batch composition (:func:`attnops._core.staging.cached_upload`: pinned, non-blocking):
    per-batch lengths (BSND) or cumulative ends (TND) of the queries; per-batch lengths (BSND, paged) or cumulative
    ends (TND, from the batches' first key rows) of the keys, a batch without query rows getting key length 0 (no
    program reads its keys). The block table stays on (or moves to) the query's device, never read here."""
    problem = call.host
    table = call.block_table
    if table is not None:
        table = table.to(device=query.device, dtype=torch.int32, non_blocking=True)
    if problem is None:
        return geometry(query, key, call.layout_query, call.layout_key, call.q_lens, call.kv_lens, table)
    q_packed = problem.layout_query == "TND"
    q_lens = tuple(start + n if q_packed else n for start, n in problem.spans)
    k_lens = tuple(k if n else 0 for k, (_, n) in zip(problem.key_lens, problem.spans))
    if problem.layout_key == "TND":
        starts = problem.keys.start.tolist()
        k_lens = (*starts[1:], starts[-1] + k_lens[-1])
    return geometry(query, key, problem.layout_query, problem.layout_key, _upload("q", q_lens, query.device),
                    _upload("kv", k_lens, query.device), table)


def _upload(side: str, values: tuple, device: torch.device) -> torch.Tensor:
    return staging.cached_upload(("dsa", side, values), lambda: list(values), torch.int32, device)


def indexer_for(call, query, key, weights, sparse_count: int, return_value: bool):
    """The reference's call (:func:`~attnops.ops.dsa.indexer.lightning_indexer_forward`) on the kernel."""
    return lightning_indexer(geometry_of(call, query, key), query, key, weights, sparse_count,
                             call.sparse_mode == 3, return_value)


def sparse_attention_for(call, query, key, value, sparse_indices, query_rope, key_rope, sinks, scale, block):
    """The reference's call (:func:`~attnops.ops.dsa.sparse_attention.sparse_attention_forward`) on the kernel;
    the statistics are always computed (the operator returns them)."""
    return sparse_flash_attention(geometry_of(call, query, key), query, query_rope,
                                  plain_cache(key, value, key_rope), sparse_indices, scale, block,
                                  call.sparse_mode == 3, True, sinks)


def quant_sparse_attention_for(call, query, key, sparse_indices, sinks, scale, block, rope_dim: int):
    """Sparse attention over a packed quantized cache: ``query [.., N1, 512 + rope_dim]`` split by views."""
    d = query.shape[-1] - rope_dim
    return sparse_flash_attention(geometry_of(call, query, key), query[..., :d], query[..., d:],
                                  packed_cache(key, query.dtype), sparse_indices, scale, block,
                                  call.sparse_mode == 3, True, sinks)
