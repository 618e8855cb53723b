"""Host side of the indexer KL loss's kernels (``kl_loss.py``): outputs, grids and the inverted lists of the
deterministic ``d_key_index``. As for sparse attention's backward, nothing is read back from the device: the lengths
and indices are read by the kernels, and the lists are ordered by torch ops on the device
(:meth:`~attnops.ops.common.inverted_lists.InvertedLists.schedule`) between the row kernel and the key kernels.
"""
from __future__ import annotations

import torch

from ...._core.triton.launch import Launch, pow2, unit_last_stride
from ...._core.triton.support import interpreting
from ...common.inverted_lists import InvertedLists, list_chunk
from .backward import _key_layout, run_around_lists
from .family import BACKWARD_KEYS, precision_flags
from .launch import Geometry, _idx_strides, _row_strides, _token_strides, geometry_of


def kl_loss_plan(g: Geometry, query, key, query_index, key_index, weights, sparse_indices, softmax_max,
                 softmax_sum, query_rope, key_rope, scale: float, interpret: bool):
    """``((d_query_index, d_key_index, d_weights, loss), launches, lists)``: the row kernel and the sum of the rows'
    losses, then (after ``lists.schedule()``, when ``lists`` is not None) ``d_key_index`` per list chunk and the
    fixed-order sum of the split lists' partials. Gradients in their inputs' shapes and dtypes, the loss fp32 ``[1]``;
    ``softmax_max``/``softmax_sum``: the sparse attention's statistics (fp32 or fp64)."""
    q, k, qi, ki, w, idx = (unit_last_stride(x) for x in (query, key, query_index, key_index, weights,
                                                           sparse_indices))
    qr, kr = (None if x is None else unit_last_stride(x) for x in (query_rope, key_rope))
    nothing = qi.numel() == 0 or ki.numel() == 0  # no row or no key: zero gradients and loss, no launch
    d_qi, d_w = ((torch.zeros if nothing else torch.empty)(x.shape, dtype=x.dtype, device=x.device) for x in (qi, w))
    d_ki = torch.zeros(ki.shape, dtype=ki.dtype, device=ki.device)  # rows no entry selects stay 0
    loss = (torch.zeros if nothing else torch.empty)(1, dtype=torch.float32, device=q.device)
    outputs = (d_qi, d_ki, d_w, loss)
    if nothing:
        return outputs, [], None
    rows, batches = g.grid_rows
    count = idx.shape[-1]
    heads, d, rope_d = q.shape[-2], q.shape[-1], 0 if kr is None else kr.shape[-1]
    index_heads, index_d = qi.shape[-2], qi.shape[-1]
    inner_rows, n_lists = _key_layout(ki, g.kv_mode)
    smax, ssum = (x.reshape(-1).contiguous() for x in (softmax_max, softmax_sum))
    d_i, row_loss = (torch.empty(n, dtype=torch.float32, device=q.device) for n in (rows * batches * count,
                                                                                    rows * batches))
    keys = torch.empty((rows * batches, count), dtype=torch.int64, device=q.device)
    span = torch.empty((rows * batches, count), dtype=torch.int32, device=q.device)
    (q_lens, kv_lens, _), (q_lens_stride, kv_lens_stride, _) = g.length_args(q.device, idx)
    qr_arg, kr_arg = (q if qr is None else qr), (k if kr is None else kr)
    row_launch = Launch("indexer_kl_loss_kernel", g.grid_rows,
                        (q, qr_arg, k, kr_arg, qi, ki, w, idx, smax, ssum, d_qi, d_w, d_i, row_loss, keys, span,
                         q_lens, kv_lens, *_token_strides(q, g.q_packed), *_token_strides(qr_arg, g.q_packed),
                         *_token_strides(qi, g.q_packed), *_token_strides(w, g.q_packed),
                         *_token_strides(d_qi, g.q_packed), *_token_strides(d_w, g.q_packed),
                         *_row_strides(k, g.kv_mode), *_row_strides(kr_arg, g.kv_mode), *_row_strides(ki, g.kv_mode),
                         *_idx_strides(idx, g.q_packed), q_lens_stride, kv_lens_stride, g.s1, g.s2, g.n_batch,
                         heads, d, rope_d, index_heads, index_d, count, inner_rows, n_lists, float(scale)),
                        dict(**g.constexprs(True), HAS_ROPE=kr is not None, BLOCK_H=pow2(heads),
                             BLOCK_G=pow2(index_heads), BLOCK_DI=pow2(index_d),
                             **precision_flags(q.dtype, interpret)))
    sum_launch = Launch("indexer_kl_loss_sum_kernel", (1,), (row_loss, loss, rows * batches), {})
    lists = InvertedLists.allocate(keys, n_lists, list_chunk(keys.numel(), n_lists, index_heads, interpret), 1,
                                   (index_d,), 1)
    dki_strides = _row_strides(d_ki, g.kv_mode)
    dk_launch = Launch("indexer_kl_loss_dk_kernel", (lists.unit_ids.numel(),),
                       (qi, ki, w, d_i, d_ki, lists.part_k, lists.list_start, lists.token, lists.unit_list,
                        lists.unit_end, lists.slot_end, *_token_strides(qi, g.q_packed),
                        *_token_strides(w, g.q_packed), *_row_strides(ki, g.kv_mode), *dki_strides, g.s1,
                        index_heads, index_d, count, inner_rows, n_lists, lists.chunk),
                       dict(Q_PACKED=g.q_packed, BLOCK_DI=pow2(index_d)))
    # the split lists' partials: sparse attention's reduction with one-row blocks, no rope, no separate value
    reduce_launch = Launch("sparse_attention_dkdv_reduce_kernel", (n_lists,),
                           (d_ki, d_ki, d_ki, lists.part_k, lists.part_k, span, lists.list_start, lists.token,
                            lists.slot_end, *dki_strides * 3, index_d, 0, index_d, 1, inner_rows, lists.chunk),
                           dict(HAS_ROPE=False, V_IS_K=True, BLOCK_D=pow2(index_d), BLOCK_R=pow2(0),
                                BLOCK_DV=pow2(index_d), BLOCK_N=BACKWARD_KEYS))
    return outputs, [row_launch, sum_launch, dk_launch, reduce_launch], lists


def indexer_kl_loss(g: Geometry, query, key, query_index, key_index, weights, sparse_indices, softmax_max,
                    softmax_sum, query_rope, key_rope, scale: float):
    """Runs :func:`kl_loss_plan`; returns ``(d_query_index, d_key_index, d_weights, loss)``."""
    outputs, launches, lists = kl_loss_plan(g, query, key, query_index, key_index, weights, sparse_indices,
                                            softmax_max, softmax_sum, query_rope, key_rope, scale,
                                            interpreting(query.device))
    run_around_lists(launches, lists, 2, query.device)
    return outputs


def kl_loss_for(call, query, key, query_index, key_index, weights, sparse_indices, softmax_max, softmax_sum,
                query_rope, key_rope, *, scale: float):
    """The reference's call (:func:`~attnops.ops.dsa.kl_loss.indexer_kl_loss_grad`) on the kernels."""
    return indexer_kl_loss(geometry_of(call, query, key), query, key, query_index, key_index, weights,
                           sparse_indices, softmax_max, softmax_sum, query_rope, key_rope, scale)
