"""NSA and DSA operators under KV all-gather context parallelism (layout TND).

The key sets of these operators span the whole sequence, so the keys are gathered
(:func:`attnops.distributed.allgather_sequence`, whose backward reduce-scatters their gradients) and each rank runs
the operators' public functions on its own query rows (:func:`.allgather.local_segments`) at their global
positions:

* DSA (:func:`attnops.lightning_indexer`, :func:`attnops.sparse_flash_attention`,
  :func:`attnops.lightning_indexer_kl_loss`): one packed call whose batches are the local segments, each against
  its sequence's keys up to the segment's end (the operators' causal rule is bottom-right aligned, so a segment
  at position ``o`` sees keys ``j <= o + i``). Indices are positions in the sequence, as on one device.
* NSA compressed attention (:func:`attnops.nsa_compress_attention`): one call per segment with its
  ``position_offset`` against its sequence's compressed keys.
* NSA selected attention (:func:`attnops.nsa_selected_attention`): its causal rule counts query rows from the
  sequence start, so a causal segment at position ``o`` runs behind ``o`` zero query rows (their gradients are
  zero); the extra rows cost as much as the positions they stand for.
"""
from __future__ import annotations

import itertools

import torch
from torch import Tensor

from .._core.checks import require
from .._core.varlen import lengths_from_cumulative
from ..ops.dsa import (LightningIndexerResult, SparseAttentionResult, lightning_indexer, lightning_indexer_kl_loss,
                       sparse_flash_attention)
from ..ops.nsa import CompressAttentionResult, nsa_compress_attention, nsa_selected_attention
from .allgather import SegmentBatches, Split, global_lens, local_segments
from .comm import check_same_across_ranks, group_info

__all__ = ["allgather_lightning_indexer", "allgather_lightning_indexer_kl_loss", "allgather_nsa_compress_attention",
           "allgather_nsa_selected_attention", "allgather_sparse_flash_attention"]


def _batches(query: Tensor, group, split: str, causal: bool, cu_seqlens, actual_seq_len, keys: dict
             ) -> tuple[SegmentBatches, list[int]]:
    """This rank's segments as packed batches, and the global lengths; checks the gathered ``keys`` (name ->
    tensor or None) hold the whole sequence."""
    info = group_info(group)
    check_same_across_ranks(info, query.device, split=split, causal=causal, cu_seqlens=cu_seqlens,
                            actual_seq_len=actual_seq_len, query=query, **keys)
    lens = global_lens("TND", query.shape[0], info, split, cu_seqlens, actual_seq_len)
    for name, t in keys.items():
        require(t is None or t.shape[0] == sum(lens), name,
                f"the gathered whole sequence ({sum(lens)} tokens; see allgather_sequence)", t)
    return SegmentBatches(tuple(local_segments(lens, info.rank, info.size, split)), causal), lens


def allgather_lightning_indexer(query: Tensor, key: Tensor, weights: Tensor, *, group=None, sparse_count: int = 2048,
                                causal: bool = True, cu_seqlens=None, actual_seq_len=None,
                                split: Split = "head_tail", return_value: bool = False) -> LightningIndexerResult:
    """:func:`attnops.lightning_indexer` for this rank's query rows ``[T_local, N1, D]`` (weights ``[T_local, N1]``)
    against the gathered ``key [T, 1, D]``; the *global* ``actual_seq_len``/``cu_seqlens``. ``causal``: sparse
    mode 3 at global positions (else 0). Indices are positions in each sequence."""
    b, _ = _batches(query, group, split, causal, cu_seqlens, actual_seq_len, {"key": key})
    return lightning_indexer(query, b.keys(key), weights, sparse_count=sparse_count, layout="TND",
                             actual_seq_lengths_query=b.q_cum, actual_seq_lengths_key=b.kv_cum,
                             sparse_mode=3 if causal else 0, return_value=return_value)


def allgather_sparse_flash_attention(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, *,
                                     group=None, scale: float | None = None, query_rope: Tensor | None = None,
                                     key_rope: Tensor | None = None, causal: bool = True, sparse_block_size: int = 1,
                                     sinks: Tensor | None = None, cu_seqlens=None, actual_seq_len=None,
                                     split: Split = "head_tail") -> SparseAttentionResult:
    """:func:`attnops.sparse_flash_attention` for this rank's query rows (and ``query_rope``, ``sparse_indices``)
    against the gathered ``key``/``value``/``key_rope`` (``value is key`` for MLA is kept); differentiable."""
    b, _ = _batches(query, group, split, causal, cu_seqlens, actual_seq_len,
                    {"key": key, "value": value, "key_rope": key_rope})
    k = b.keys(key)
    return sparse_flash_attention(query, k, k if value is key else b.keys(value), sparse_indices, scale=scale,
                                  query_rope=query_rope, key_rope=None if key_rope is None else b.keys(key_rope),
                                  layout="TND", actual_seq_lengths_query=b.q_cum, actual_seq_lengths_kv=b.kv_cum,
                                  sparse_block_size=sparse_block_size, sparse_mode=3 if causal else 0, sinks=sinks)


def allgather_lightning_indexer_kl_loss(query: Tensor, key: Tensor, query_index: Tensor, key_index: Tensor,
                                        weights: Tensor, sparse_indices: Tensor, softmax_max: Tensor,
                                        softmax_sum: Tensor, *, scale: float, group=None,
                                        query_rope: Tensor | None = None, key_rope: Tensor | None = None,
                                        cu_seqlens=None, actual_seq_len=None, split: Split = "head_tail") -> Tensor:
    """:func:`attnops.lightning_indexer_kl_loss` of this rank's query rows (``query``, ``query_index``,
    ``weights``, ``sparse_indices`` and the statistics of :func:`allgather_sparse_flash_attention`) against the
    gathered ``key``/``key_index``/``key_rope``: this rank's share of the loss (the ranks' shares sum to the
    single-device loss); gradients reach ``key_index``'s owners through :func:`allgather_sequence`."""
    b, _ = _batches(query, group, split, True, cu_seqlens, actual_seq_len,
                    {"key": key, "key_index": key_index, "key_rope": key_rope})
    return lightning_indexer_kl_loss(query, b.keys(key), query_index, b.keys(key_index), weights, sparse_indices,
                                     softmax_max, softmax_sum, scale=scale, query_rope=query_rope,
                                     key_rope=None if key_rope is None else b.keys(key_rope), layout="TND",
                                     actual_seq_lengths_query=b.q_cum, actual_seq_lengths_key=b.kv_cum)


def allgather_nsa_compress_attention(query: Tensor, key: Tensor, value: Tensor, *, compress_block_size: int,
                                     compress_stride: int, select_block_size: int, select_block_count: int,
                                     group=None, scale: float | None = None, causal: bool = True,
                                     local_blocks: int | None = None, cu_seqlens=None, actual_seq_len=None,
                                     actual_cmp_seq_kvlen=None, split: Split = "head_tail"
                                     ) -> CompressAttentionResult:
    """:func:`attnops.nsa_compress_attention` (``causal``/``local_blocks`` rules) for this rank's query rows against
    the compressed ``key``/``value`` of the whole sequence (:func:`attnops.nsa_compress` of the gathered keys;
    ``actual_cmp_seq_kvlen``: their global cumulative lengths, default one sequence). Returns the local rows of
    the output, top-k indices (per sequence, as on one device) and statistics."""
    b, lens = _batches(query, group, split, causal, cu_seqlens, actual_seq_len, {})
    cmp_cum = [key.shape[0]] if actual_cmp_seq_kvlen is None else list(actual_cmp_seq_kvlen)
    cmp_lens = lengths_from_cumulative("actual_cmp_seq_kvlen", cmp_cum, key.shape[0])
    require(len(cmp_lens) == len(lens), "actual_cmp_seq_kvlen", f"{len(lens)} sequences (as actual_seq_len)",
            cmp_cum)
    cmp_start = dict(zip(itertools.accumulate([0, *lens]), itertools.accumulate([0, *cmp_lens])))
    seq_cmp_len = dict(zip(itertools.accumulate([0, *lens]), cmp_lens))
    parts = []
    for s in b.segments:
        c0, n = cmp_start[s.seq_start], seq_cmp_len[s.seq_start]
        parts.append(nsa_compress_attention(
            query.narrow(0, s.local_start, s.length), key.narrow(0, c0, n), value.narrow(0, c0, n),
            compress_block_size=compress_block_size, compress_stride=compress_stride,
            select_block_size=select_block_size, select_block_count=select_block_count, scale=scale, causal=causal,
            local_blocks=local_blocks, position_offset=s.start - s.seq_start, actual_seq_qlen=[s.length],
            actual_cmp_seq_kvlen=[n]))
    return CompressAttentionResult(*(torch.cat(field, 0) for field in zip(*parts)))


def allgather_nsa_selected_attention(query: Tensor, key: Tensor, value: Tensor, topk_indices: Tensor, *,
                                     select_block_size: int, group=None, causal: bool = True,
                                     scale: float | None = None, cu_seqlens=None, actual_seq_len=None,
                                     split: Split = "head_tail", return_stats: bool = False):
    """:func:`attnops.nsa_selected_attention` for this rank's query rows and ``topk_indices`` against the gathered
    ``key``/``value``; differentiable. Returns the local output (``return_stats``: with the statistics)."""
    b, _ = _batches(query, group, split, causal, cu_seqlens, actual_seq_len, {"key": key, "value": value})
    outs = []
    for s in b.segments:
        q, idx = query.narrow(0, s.local_start, s.length), topk_indices.narrow(0, s.local_start, s.length)
        pad = s.start - s.seq_start if causal else 0
        if pad:  # rows 0..pad-1 stand for the positions before the segment (the causal rule counts from row 0)
            q = torch.cat([q.new_zeros(pad, *q.shape[1:]), q])
            filler = torch.arange(idx.shape[-1], dtype=idx.dtype, device=idx.device).expand(pad, *idx.shape[1:])
            idx = torch.cat([filler, idx])
        res = nsa_selected_attention(q, key.narrow(0, s.seq_start, s.seq_end - s.seq_start),
                                     value.narrow(0, s.seq_start, s.seq_end - s.seq_start), idx,
                                     select_block_size=select_block_size, causal=causal, scale=scale,
                                     actual_seq_qlen=[q.shape[0]], actual_seq_kvlen=[s.seq_end - s.seq_start],
                                     return_stats=True)
        outs.append([t.narrow(0, pad, s.length) for t in res])
    out, smax, ssum = (torch.cat(field, 0) for field in zip(*outs))
    return (out, smax, ssum) if return_stats else out
