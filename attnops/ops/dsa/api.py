"""Pythonic DeepSeek sparse attention API: the lightning indexer, sparse flash attention (differentiable, any
device, also over an int8/fp8 packed cache) and the indexer's KL loss (differentiable in the indexer's inputs).
No math here: validation and dispatch happen in the custom ops (:mod:`.op`)."""
from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from ..._core.checks import check_tensor, softmax_scale
from ..._core.custom_ops import call

QueryLayout = Literal["BSND", "TND"]
KeyLayout = Literal["BSND", "TND", "PA_BSND"]


def _op():
    from . import op

    return op


def _lengths(x) -> Tensor | None:
    """Lengths as the ops take them: an int tensor (lists become CPU int32 tensors)."""
    return torch.tensor(list(x), dtype=torch.int32) if isinstance(x, (list, tuple)) else x


class LightningIndexerResult(NamedTuple):
    """``sparse_indices`` int32 ``[B, S1, 1, K]`` / ``[T1, 1, K]`` (descending scores, -1 tails) and
    ``sparse_values`` (same shape, query's dtype, -inf at -1; an empty ``[0]`` unless ``return_value``)."""
    sparse_indices: Tensor
    sparse_values: Tensor


class SparseAttentionResult(NamedTuple):
    """``attention_out`` (query's shape, value's head dim) and the softmax statistics ``softmax_max`` /
    ``softmax_sum`` fp32 ``[B, 1, S1, N1]`` (BSND) or ``[1, T1, N1]`` (TND): ``lse = max + log(sum)``."""
    attention_out: Tensor
    softmax_max: Tensor
    softmax_sum: Tensor


def lightning_indexer(query: Tensor, key: Tensor, weights: Tensor, *, sparse_count: int = 2048,
                      layout: QueryLayout = "BSND", layout_key: KeyLayout | None = None,
                      actual_seq_lengths_query=None, actual_seq_lengths_key=None, block_table: Tensor | None = None,
                      sparse_mode: int = 3, return_value: bool = False) -> LightningIndexerResult:
    """Top-``sparse_count`` key positions per query token by the DSA lightning indexer's score
    ``sum_h weights[i, h] * relu(query[i, h] . key[j])`` (no scale, no softmax: fold scaling into ``weights``).

    query ``[B, S1, N1, D]`` / ``[T1, N1, D]``; key ``[B, S2, 1, D]`` / ``[T2, 1, D]`` / a paged cache
    ``[blocks, block_size, 1, D]`` with ``block_table [B, max_blocks]`` (``layout_key="PA_BSND"``; default: the
    query's layout); weights ``[B, S1, N1]`` / ``[T1, N1]``. Lengths: per batch for BSND and paged keys, cumulative
    (no leading 0, required) for TND. ``sparse_mode`` 3: query row ``i`` sees keys ``j <= Lk - Lq + i``; 0: all.
    Rows get ``min(sparse_count, allowed keys)`` positions, most relevant first, then -1; padding rows are all -1.
    Memory is linear in the sequence (no ``[S1, S2]`` score matrix). Not differentiable (the indexer trains with
    :func:`lightning_indexer_kl_loss`).

    >>> q, k, w = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 1, 16), torch.rand(1, 8, 4)
    >>> lightning_indexer(q, k, w, sparse_count=4).sparse_indices[0, 7, 0].tolist() != [-1] * 4
    True
    """
    indices, values = call(_op().dsa_lightning_indexer, query, key, weights, _lengths(actual_seq_lengths_query),
                           _lengths(actual_seq_lengths_key), block_table, layout, layout_key or layout, sparse_count,
                           sparse_mode, return_value)
    return LightningIndexerResult(indices, values)


def sparse_flash_attention(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, *,
                           scale: float | None = None, query_rope: Tensor | None = None,
                           key_rope: Tensor | None = None, layout: QueryLayout = "BSND",
                           layout_kv: KeyLayout | None = None, actual_seq_lengths_query=None,
                           actual_seq_lengths_kv=None, block_table: Tensor | None = None, sparse_block_size: int = 1,
                           sparse_mode: int = 3, sinks: Tensor | None = None) -> SparseAttentionResult:
    """Attention of each query token over only the key positions its ``sparse_indices`` row lists (DSA; MLA-absorbed
    when ``key`` and ``value`` are the same latent tensor and the rope parts are given).

    query ``[B, S1, N1, D]`` / ``[T1, N1, D]``; key/value ``[B, S2, 1, D]`` / ``[T2, 1, D]`` / paged
    ``[blocks, block_size, 1, D]`` (with ``block_table``, ``layout_kv="PA_BSND"``); sparse_indices int32
    ``[.., 1, K]`` of logical key positions (blocks of ``sparse_block_size`` positions), -1 padded;
    ``query_rope``/``key_rope``: the rope parts (last dim Dr), added to the logit;
    ``scale`` (default ``1/sqrt(D + Dr)``) multiplies the logits; ``sinks [N1]`` fp32: per-head sink logits (no
    gradient). Causal rule and lengths as in :func:`lightning_indexer`. Rows without any key return 0.
    Differentiable in query, key, value, query_rope and key_rope.

    >>> q, kv = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 1, 16)
    >>> idx = torch.arange(8, dtype=torch.int32).expand(1, 8, 1, 8).contiguous()
    >>> sparse_flash_attention(q, kv, kv, idx).attention_out.shape
    torch.Size([1, 8, 4, 16])
    """
    check_tensor("query", query)
    d = query.shape[-1] + (0 if query_rope is None else query_rope.shape[-1])
    out, m, l = call(_op().dsa_sparse_flash_attention, query, key, value, sparse_indices, query_rope, key_rope, sinks,
                     block_table, _lengths(actual_seq_lengths_query), _lengths(actual_seq_lengths_kv),
                     softmax_scale(scale, query, d), sparse_block_size, layout, layout_kv or layout, sparse_mode)
    return SparseAttentionResult(out, m, l)


def lightning_indexer_kl_loss(query: Tensor, key: Tensor, query_index: Tensor, key_index: Tensor, weights: Tensor,
                              sparse_indices: Tensor, softmax_max: Tensor, softmax_sum: Tensor, *, scale: float,
                              query_rope: Tensor | None = None, key_rope: Tensor | None = None,
                              layout: QueryLayout = "BSND", actual_seq_lengths_query=None,
                              actual_seq_lengths_key=None) -> Tensor:
    """The DSA indexer's training loss ``sum_t KL(P_t || softmax(I_t))`` (fp32 ``[1]``): ``P`` is the main sparse
    attention's head-averaged distribution over the selected keys (from its ``softmax_max``/``softmax_sum``,
    :func:`sparse_flash_attention`'s statistics with the same indices and ``scale``), ``I`` the indexer's scores.
    Differentiable in ``query_index``, ``key_index`` and ``weights`` (the gradients come from the fused backward op,
    computed with the loss); the main attention's tensors get no gradient. Causal (mode 3); lengths: TND only,
    cumulative lists."""
    target = [None if t is None else t.detach() for t in (query, key, softmax_max, softmax_sum, query_rope, key_rope)]
    query, key, softmax_max, softmax_sum, query_rope, key_rope = target  # the target distribution: constants
    return call(_op().dsa_indexer_kl_loss_grad, query, key, query_index, key_index, weights, sparse_indices,
                softmax_max, softmax_sum, query_rope, key_rope, float(scale), _lengths(actual_seq_lengths_query),
                _lengths(actual_seq_lengths_key), layout, 3)[3]
