"""Host side of sparse flash attention's backward kernels (``sparse_attention_bwd.py``): outputs, grids and the
inverted lists of the deterministic dK/dV. Like the forward's plans, nothing is read back from the device: the
lengths, block table and indices are read by the kernels, and the lists are ordered by torch ops on the device
(:meth:`~attnops.ops.common.inverted_lists.InvertedLists.schedule`) between the dQ launch and the dK/dV ones.
"""
from __future__ import annotations

import torch

from ...._core.triton.launch import Launch, cdiv, pow2, unit_last_stride
from ...._core.triton.support import interpreting
from ...common.inverted_lists import InvertedLists, list_chunk
from .family import BACKWARD_KEYS, KERNELS, backward_head_tile, dk_tile, dq_tile, precision_flags
from .launch import Geometry, LatentCache, _idx_strides, _row_strides, _token_strides, geometry_of, plain_cache


def _key_layout(key: torch.Tensor, kv_mode: int) -> tuple[int, int]:
    """``(inner_rows, rows)``: rows per outer index of a key-side tensor (``key_rows``' coordinates: S2, the page,
    or every packed row) and its flat row count (the inverted lists: one per row a block can start at)."""
    if kv_mode == 1:
        return key.shape[0], key.shape[0]
    return key.shape[1], key.shape[0] * key.shape[1]


def attention_backward_plan(g: Geometry, grad, query, query_rope, cache: LatentCache, sparse_indices, out,
                            softmax_max, softmax_sum, scale: float, sparse_block_size: int, causal: bool,
                            interpret: bool):
    """``((dq, dk, dv, dq_rope, dk_rope), launches, lists)``: dQ with ``D`` and the lists' keys, then (after
    ``lists.schedule()``, when ``lists`` is not None) dK/dV per list chunk and the fixed-order sum of the split
    lists' partials. ``dv`` is zero when the value is the key's latent (its gradient is in ``dk``); the rope
    gradients are None without rope. ``softmax_max``/``softmax_sum``: the forward's statistics, flat ``[R, N1]``."""
    q, idx, o, do = (unit_last_stride(x) for x in (query, sparse_indices, out, grad))
    qr = None if query_rope is None else unit_last_stride(query_rope)
    k = unit_last_stride(cache.latent)
    v = k if cache.value is None else unit_last_stride(cache.value)
    kr = None if cache.rope is None else unit_last_stride(cache.rope)
    heads, d, dv_width, rope_d = q.shape[-2], k.shape[-1], v.shape[-1], 0 if kr is None else kr.shape[-1]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dqr = None if qr is None else torch.empty_like(qr, memory_format=torch.contiguous_format)
    dk, dkr, dv = (None if x is None else torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (k, kr, v))
    outputs = (dq, dk, dv, dqr, dkr)
    if dq.numel() == 0 or k.numel() == 0:
        return outputs, [], None
    smax, ssum = (x.reshape(-1).float().contiguous() for x in (softmax_max, softmax_sum))
    rows, batches = g.grid_rows
    count = idx.shape[-1]
    inner_rows, n_lists = _key_layout(k, g.kv_mode)
    v_is_k = cache.value is None
    delta = torch.empty(rows * batches * heads, dtype=torch.float32, device=q.device)
    keys = torch.empty((rows * batches, count), dtype=torch.int64, device=q.device)
    span = torch.empty((rows * batches, count), dtype=torch.int32, device=q.device)
    (q_lens, kv_lens, table), lens_strides = g.length_args(q.device, idx)
    block_h, block_dq = backward_head_tile(heads, q.dtype, interpret), dq_tile(d, interpret)
    dq_tiles = cdiv(d, block_dq)
    flags = dict(HAS_ROPE=kr is not None, BLOCK_R=pow2(rope_d), **precision_flags(q.dtype, interpret))
    qr_arg, kr_arg = (q if qr is None else qr), (k if kr is None else kr)
    dq_launch = Launch("sparse_attention_dq_kernel", (rows, batches, cdiv(heads, block_h) * dq_tiles),
                       (q, qr_arg, k, kr_arg, v, idx, o, do, smax, ssum, dq, dq if dqr is None else dqr, delta, keys,
                        span, q_lens, kv_lens, table, *_token_strides(q, g.q_packed),
                        *_token_strides(qr_arg, g.q_packed), *_token_strides(o, g.q_packed),
                        *_token_strides(do, g.q_packed), *_token_strides(dq, g.q_packed),
                        *_token_strides(dq if dqr is None else dqr, g.q_packed), *_row_strides(k, g.kv_mode),
                        *_row_strides(kr_arg, g.kv_mode), *_row_strides(v, g.kv_mode), *_idx_strides(idx, g.q_packed),
                        *lens_strides, g.s1, g.s2, g.n_batch, heads, d, rope_d, dv_width, dq_tiles, g.page,
                        g.n_pages, count, sparse_block_size, inner_rows, n_lists, float(scale)),
                       dict(**g.constexprs(causal), BLOCK_H=block_h, BLOCK_DQ=block_dq, **flags))
    lists = InvertedLists.allocate(keys, n_lists, list_chunk(keys.numel(), n_lists, heads, interpret),
                                   sparse_block_size, (d + rope_d,) if v_is_k else (d + rope_d, dv_width), 1)
    part_v = lists.part_k if lists.part_v is None else lists.part_v
    dk_strides = (*_row_strides(dk, g.kv_mode), *_row_strides(dk if dkr is None else dkr, g.kv_mode),
                  *_row_strides(dk if v_is_k else dv, g.kv_mode))
    common = (dk, dk if dkr is None else dkr, dk if v_is_k else dv, lists.part_k, part_v)
    block_n, block_dk = BACKWARD_KEYS, dk_tile(max(d, dv_width), q.dtype, interpret)
    tiles, col_tiles = cdiv(sparse_block_size, block_n), cdiv(max(d, dv_width), block_dk)
    dkdv_launch = Launch("sparse_attention_dkdv_kernel", (lists.unit_ids.numel() * tiles * col_tiles,),
                         (q, qr_arg, do, k, kr_arg, v, *common, delta, smax, ssum, span, lists.list_start,
                          lists.token, lists.unit_list, lists.unit_end, lists.slot_end,
                          *_token_strides(q, g.q_packed), *_token_strides(qr_arg, g.q_packed),
                          *_token_strides(do, g.q_packed), *_row_strides(k, g.kv_mode),
                          *_row_strides(kr_arg, g.kv_mode), *_row_strides(v, g.kv_mode), *dk_strides, g.s1, heads, d,
                          rope_d, dv_width, col_tiles, count, sparse_block_size, inner_rows, n_lists, lists.chunk,
                          float(scale)),
                         dict(Q_PACKED=g.q_packed, V_IS_K=v_is_k, BLOCK_DK=block_dk, BLOCK_N=block_n, **flags))
    reduce_launch = Launch("sparse_attention_dkdv_reduce_kernel", (n_lists * tiles,),
                           (*common, span, lists.list_start, lists.token, lists.slot_end, *dk_strides, d, rope_d,
                            dv_width, sparse_block_size, inner_rows, lists.chunk),
                           dict(HAS_ROPE=kr is not None, V_IS_K=v_is_k, BLOCK_D=pow2(d), BLOCK_R=pow2(rope_d),
                                BLOCK_DV=pow2(dv_width), BLOCK_N=block_n))
    return outputs, [dq_launch, dkdv_launch, reduce_launch], lists


def sparse_flash_attention_backward(g: Geometry, grad, query, query_rope, cache: LatentCache, sparse_indices, out,
                                    softmax_max, softmax_sum, scale: float, sparse_block_size: int, causal: bool):
    """Runs :func:`attention_backward_plan`; returns ``(dq, dk, dv, dq_rope, dk_rope)``."""
    outputs, launches, lists = attention_backward_plan(g, grad, query, query_rope, cache, sparse_indices, out,
                                                       softmax_max, softmax_sum, scale, sparse_block_size, causal,
                                                       interpreting(query.device))
    run_around_lists(launches, lists, 1, query.device)
    return outputs


def run_around_lists(launches: list, lists: InvertedLists | None, first: int, device) -> None:
    """The first ``first`` launches (they write the inverted lists' keys), the lists ordered on the device, then the
    launches that read them (none without lists)."""
    KERNELS.run_all(launches[:first], device)
    if lists is not None:
        lists.schedule()
        KERNELS.run_all(launches[first:], device)


def sparse_attention_grad_for(call, grad, query, key, value, sparse_indices, query_rope, key_rope, out, softmax_max,
                              softmax_sum, scale, block):
    """The reference's call (:func:`~attnops.ops.dsa.sparse_attention.sparse_attention_backward`) on the kernels:
    ``(dq, dk, dv, dq_rope, dk_rope)`` in the inputs' shapes."""
    return sparse_flash_attention_backward(geometry_of(call, query, key), grad, query, query_rope,
                                           plain_cache(key, value, key_rope), sparse_indices, out, softmax_max,
                                           softmax_sum, scale, block, call.sparse_mode == 3)
