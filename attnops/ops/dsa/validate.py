"""Validation of the DSA ops' arguments (before any compute), returning the call's :class:`~.call.Call` (its
normal form, or its device lengths left to the kernels).

General shapes are accepted (any head dims and head counts, one kv head); the torch_npu layer adds the NPU's own
limits on top (:mod:`attnops.torch_npu.dsa`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..._core.checks import check_int, check_same_device, check_tensor, require, require_not_none
from ..._core.indices import check_block_table, check_index_rows, entries_read, validation_enabled
from .call import Call, make_call
from .problem import INDEX_DTYPES
from .quant_cache import CODE_DTYPES, HIF8_STORAGE_DTYPES, NOPE_DIM, ROPE_DIM, ROW_BYTES

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SPARSE_COUNTS_MAX = 8192


def _check_like(name: str, x: Tensor | None, shape: tuple, dtype: torch.dtype | None, what: str) -> None:
    if x is None:
        return
    check_tensor(name, x, dtypes=None if dtype is None else (dtype,))
    require(tuple(x.shape) == tuple(shape), name, f"shape {list(shape)} ({what})", x)


def _check_rope(query: Tensor, key: Tensor, query_rope: Tensor | None, key_rope: Tensor | None) -> None:
    require((query_rope is None) == (key_rope is None), "key_rope" if key_rope is None else "query_rope",
            "query_rope and key_rope together (or neither)", None)
    if query_rope is not None:
        _check_like("query_rope", query_rope, (*query.shape[:-1], query_rope.shape[-1]), query.dtype,
                    "query's shape with the rope dim")
        _check_like("key_rope", key_rope, (*key.shape[:-1], query_rope.shape[-1]), query.dtype,
                    "key's shape with query_rope's rope dim")


def indexer_call(query: Tensor, key: Tensor, weights: Tensor, *, actual_seq_lengths_query,
                    actual_seq_lengths_key, block_table, layout_query: str, layout_key: str, sparse_count: int,
                    sparse_mode: int, return_value: bool) -> Call:
    check_same_device("query", query, key=key, weights=weights, block_table=block_table)
    check_tensor("query", query, dtypes=FLOAT_DTYPES)
    check_tensor("key", key, dtypes=(query.dtype,))
    check_tensor("weights", weights, dtypes=tuple({query.dtype, torch.float32, torch.float64}))
    check_int("sparse_count", sparse_count, lo=1, hi=SPARSE_COUNTS_MAX)
    call = make_call(query, key, layout_query=layout_query, layout_key=layout_key, sparse_mode=sparse_mode,
                     actual_seq_lengths_query=actual_seq_lengths_query,
                     actual_seq_lengths_key=actual_seq_lengths_key, block_table=block_table)
    require(key.shape[-1] == query.shape[-1], "key", f"head dim D={query.shape[-1]} like query", key)
    _check_like("weights", weights, query.shape[:-1], None, "query's shape without D")
    require(not (return_value and layout_key == "PA_BSND"), "return_value", "False with layout_key 'PA_BSND'",
            return_value)
    check_index_values(call, query, key, key_lengths_name="actual_seq_lengths_key")
    return call


def sparse_attention_call(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, *,
                             query_rope, key_rope, sinks, block_table, actual_seq_lengths_query,
                             actual_seq_lengths_kv, layout_query: str, layout_kv: str, sparse_mode: int,
                             sparse_block_size: int) -> Call:
    check_same_device("query", query, key=key, value=value, sparse_indices=sparse_indices, query_rope=query_rope,
                      key_rope=key_rope, sinks=sinks, block_table=block_table)
    check_tensor("query", query, dtypes=FLOAT_DTYPES)
    call = make_call(query, key, layout_query=layout_query, layout_key=layout_kv, sparse_mode=sparse_mode,
                     actual_seq_lengths_query=actual_seq_lengths_query,
                     actual_seq_lengths_key=actual_seq_lengths_kv, block_table=block_table,
                     key_lengths_name="actual_seq_lengths_kv")
    check_tensor("key", key, dtypes=(query.dtype,))
    require(key.shape[-1] == query.shape[-1], "key", f"head dim D={query.shape[-1]} like query", key)
    check_tensor("value", value, dtypes=(query.dtype,))
    require(tuple(value.shape[:-1]) == tuple(key.shape[:-1]), "value", f"key's shape but D ({list(key.shape)})",
            value)
    check_sparse_indices(sparse_indices, query)
    _check_block(sparse_block_size, key, layout_kv)
    _check_rope(query, key, query_rope, key_rope)
    _check_sinks(sinks, query)
    check_index_values(call, query, key, sparse_indices, sparse_block_size)
    return call


def _check_block(sparse_block_size: int, key: Tensor, layout_kv: str) -> None:
    block = check_int("sparse_block_size", sparse_block_size, lo=1, hi=128)
    require(block & (block - 1) == 0, "sparse_block_size", "a power of two in [1, 128]", block)
    if layout_kv == "PA_BSND":
        require(key.shape[1] % block == 0, "sparse_block_size", f"a divisor of the cache's block_size {key.shape[1]}",
                block)


def _check_sinks(sinks: Tensor | None, query: Tensor) -> None:
    if sinks is not None:
        check_tensor("sinks", sinks, dtypes=(torch.float32, torch.float64))
        _check_like("sinks", sinks, (query.shape[-2],), None, "one sink logit per query head")


def quant_sparse_attention_call(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, *, sinks,
                                   block_table, actual_seq_lengths_query, actual_seq_lengths_kv, layout_query: str,
                                   layout_kv: str, sparse_mode: int, sparse_block_size: int,
                                   rope_head_dim: int, hif8: bool) -> Call:
    """A call over the packed cache: query ``[.., N1, 512 + 64]``, key ``[.., 1, 656]`` int8 / fp8 rows, or
    HiFloat8 rows in uint8 / int8 storage (``hif8``)."""
    check_same_device("query", query, key=key, value=value, sparse_indices=sparse_indices, sinks=sinks,
                      block_table=block_table)
    require(rope_head_dim == ROPE_DIM, "rope_head_dim", str(ROPE_DIM), rope_head_dim)
    check_tensor("query", query, dtypes=(torch.float16, torch.bfloat16))  # the rows store the rope in its dtype
    require(query.shape[-1] == NOPE_DIM + ROPE_DIM, "query", f"head dim {NOPE_DIM + ROPE_DIM} (nope | rope)", query)
    check_tensor("key", key, dtypes=HIF8_STORAGE_DTYPES if hif8 else CODE_DTYPES)
    require(key.shape[-1] == ROW_BYTES, "key", f"packed rows of {ROW_BYTES} bytes (last dim)", key)
    check_tensor("value", value, dtypes=(key.dtype,), shape=tuple(key.shape))  # the same packed rows as key
    call = make_call(query, key, layout_query=layout_query, layout_key=layout_kv, sparse_mode=sparse_mode,
                     actual_seq_lengths_query=actual_seq_lengths_query,
                     actual_seq_lengths_key=actual_seq_lengths_kv, block_table=block_table,
                     key_lengths_name="actual_seq_lengths_kv")
    check_sparse_indices(sparse_indices, query)
    _check_block(sparse_block_size, key, layout_kv)
    _check_sinks(sinks, query)
    check_index_values(call, query, key, sparse_indices, sparse_block_size)
    return call


def check_sparse_indices(sparse_indices: Tensor, query: Tensor) -> None:
    check_tensor("sparse_indices", sparse_indices, dtypes=INDEX_DTYPES, ndim=query.dim())
    require(tuple(sparse_indices.shape[:-2]) == tuple(query.shape[:-2]) and sparse_indices.shape[-2] == 1
            and sparse_indices.shape[-1] >= 1, "sparse_indices",
            f"[{', '.join(map(str, query.shape[:-2]))}, 1, K >= 1] (query's rows, one kv head)", sparse_indices)


def kl_loss_call(query: Tensor, key: Tensor, query_index: Tensor, key_index: Tensor, weights: Tensor,
                    sparse_indices: Tensor, softmax_max: Tensor, softmax_sum: Tensor, *, query_rope, key_rope,
                    actual_seq_qlen, actual_seq_klen, layout: str, sparse_mode: int) -> Call:
    check_same_device("query", query, key=key, query_index=query_index, key_index=key_index, weights=weights,
                      sparse_indices=sparse_indices, softmax_max=softmax_max, softmax_sum=softmax_sum,
                      query_rope=query_rope, key_rope=key_rope)
    require(sparse_mode == 3, "sparse_mode", "3 (the KL loss is causal only)", sparse_mode)
    check_tensor("query", query, dtypes=FLOAT_DTYPES)
    call = make_call(query, key, layout_query=layout, layout_key=layout, sparse_mode=sparse_mode,
                     actual_seq_lengths_query=actual_seq_qlen, actual_seq_lengths_key=actual_seq_klen,
                     key_lengths_name="actual_seq_klen")
    check_tensor("key", key, dtypes=(query.dtype,))
    check_tensor("query_index", query_index, dtypes=(query.dtype,), ndim=query.dim())
    require(tuple(query_index.shape[:-2]) == tuple(query.shape[:-2]), "query_index", "query's rows", query_index)
    require_not_none(key_index, "key_index")
    _check_like("key_index", key_index, (*key.shape[:-1], query_index.shape[-1]), query.dtype,
                "key's shape with query_index's D")
    _check_like("weights", weights, query_index.shape[:-1], None, "query_index's shape without D")
    check_tensor("weights", weights, dtypes=tuple({query.dtype, torch.float32, torch.float64}))
    check_sparse_indices(sparse_indices, query)
    stats = stats_shape(query, layout)
    for name, x in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        check_tensor(name, x, dtypes=(torch.float32, torch.float64))
        require(tuple(x.shape) == stats, name, f"shape {list(stats)} (the sparse attention's statistics)", x)
    _check_rope(query, key, query_rope, key_rope)
    check_index_values(call, query, key, sparse_indices, key_lengths_name="actual_seq_klen")
    return call


def check_index_values(call: Call, query: Tensor, key: Tensor, sparse_indices: Tensor | None = None,
                       sparse_block_size: int = 1, *, key_lengths_name: str = "actual_seq_lengths_kv") -> None:
    """The values of the block table (every block a batch's keys occupy is in the cache) and of the index rows
    (every entry read is -1 or a block of ``sparse_block_size`` positions starting below the batch's key length),
    when :func:`~attnops._core.indices.validation_enabled` says so (a call on a GPU reads them back then)."""
    if not validation_enabled(query.device):
        return
    problem = call.problem()
    if problem.keys.block_table is not None:
        check_block_table(problem.keys.block_table, problem.key_lens, problem.keys.block_size, key.shape[0],
                          lengths_name=key_lengths_name)
    if sparse_indices is not None:
        idx = sparse_indices.detach().cpu()
        rows = problem.rows
        limit = rows.limit.view(*idx.shape[:-2], 1)
        read = entries_read(idx, ((limit + sparse_block_size - 1) // sparse_block_size).clamp_max(idx.shape[-1]))
        check_index_rows("sparse_indices", idx, read, rows.key_len.view(*idx.shape[:-2], 1),
                         unit=sparse_block_size, what="the batch's key length")


def stats_shape(query: Tensor, layout_query: str) -> tuple[int, ...]:
    """``softmax_max/sum``'s shape: ``[B, 1, S1, N1]`` (BSND query) or ``[1, T1, N1]`` (TND)."""
    if layout_query == "BSND":
        return (query.shape[0], 1, query.shape[1], query.shape[2])
    return (1, query.shape[0], query.shape[1])
