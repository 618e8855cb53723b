"""Pythonic DeepSeek-V4 lightning indexer (v2, over compressed keys) and its quantised form. No math here:
validation and compute happen in the custom op (:mod:`.indexer_v2_op`)."""
from __future__ import annotations

from typing import Literal, NamedTuple

from torch import Tensor

from ..._core.custom_ops import call
from . import indexer_v2_op
from .indexer_v2_quant import dequantize_indexer_inputs

QueryLayout = Literal["BSND", "TND"]
KeyLayout = Literal["BSND", "TND", "PA_BBND", "PA_BSND"]




class LightningIndexerV2Result(NamedTuple):
    """``sparse_indices`` int32 ``[B, S1, 1, topk]`` / ``[T1, 1, topk]`` (compressed key positions, best first,
    ``-1`` tails) and ``sparse_values`` (same shape, fp32, or fp64 for fp64 inputs; ``-inf`` at ``-1``)."""
    sparse_indices: Tensor
    sparse_values: Tensor


def lightning_indexer_v2(query: Tensor, key: Tensor, weights: Tensor, *, topk: int, layout: QueryLayout = "BSND",
                         layout_key: KeyLayout | None = None, cu_seqlens_q: Tensor | None = None,
                         cu_seqlens_k: Tensor | None = None, seqused_q: Tensor | None = None,
                         seqused_k: Tensor | None = None, cmp_residual_k: Tensor | None = None,
                         block_table: Tensor | None = None, output_idx_offset: Tensor | None = None,
                         mask_mode: int = 0, cmp_ratio: int = 1) -> LightningIndexerV2Result:
    """The ``topk`` compressed key positions per query token by the DeepSeek-V4 lightning indexer's score
    ``sum_h weights[t, h] * relu(query[t, h] . key[j])`` (no scale, no softmax: scaling lives in ``weights``), with
    their scores.

    query ``[B, S1, N1, D]`` (``layout="BSND"``) or ``[T1, N1, D]`` (``"TND"``, with ``cu_seqlens_q [B+1]``, leading
    0); key: compressed keys ``[B, S2, 1, D]`` / ``[T2, 1, D]`` (``cu_seqlens_k``) / a paged cache
    ``[blocks, block_size, 1, D]`` (``layout_key="PA_BBND"``, or vllm-ascend's name ``"PA_BSND"``, with
    ``block_table [B, max_blocks]`` and ``seqused_k``; default: the query's layout); weights ``[B, S1, N1]`` /
    ``[T1, N1]``. ``seqused_q`` / ``seqused_k`` ``[B]``: valid rows per batch (later rows of a batch are padding:
    all ``-1``).
    ``mask_mode`` 0: every key; 3: causal over compressed keys: row ``i`` of a batch with ``Lq`` rows and ``Lk``
    keys sits at the uncompressed position ``p = Lk * cmp_ratio + cmp_residual_k[b] - Lq + i`` and uses the keys
    ``j < (p + 1) // cmp_ratio`` (``cmp_residual_k [B]`` in ``[0, cmp_ratio)`` is required for ``cmp_ratio > 1``).
    Rows get ``min(topk, allowed keys)`` positions, by descending score with ties to the lower position, then
    ``-1`` (values ``-inf``); ``output_idx_offset`` (``[B, S1, 1]`` / ``[T1, 1]``) is added to every valid position.
    Memory is linear in the sequence (no ``[S1, S2]`` score matrix). Not differentiable.

    >>> q, k, w = torch.randn(1, 8, 4, 16), torch.randn(1, 2, 1, 16), torch.rand(1, 8, 4)
    >>> r = lightning_indexer_v2(q, k, w, topk=2, mask_mode=3, cmp_ratio=4, cmp_residual_k=torch.tensor([0]))
    >>> r.sparse_indices[0, :, 0].tolist()[:4], sorted(r.sparse_indices[0, 7, 0].tolist())
    ([[-1, -1], [-1, -1], [-1, -1], [0, -1]], [0, 1])
    """
    return LightningIndexerV2Result(*call(
        indexer_v2_op.dsv4_lightning_indexer_v2, query, key, weights, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        cmp_residual_k, block_table, output_idx_offset, topk, layout, layout_key or layout, mask_mode, cmp_ratio))


def quant_lightning_indexer_v2(query: Tensor, key: Tensor, weights: Tensor, query_dequant_scale: Tensor,
                               key_dequant_scale: Tensor, *, topk: int, query_quant_mode: int = 0,
                               key_quant_mode: int = 0, layout: QueryLayout = "BSND",
                               layout_key: KeyLayout | None = None, cu_seqlens_q: Tensor | None = None,
                               cu_seqlens_k: Tensor | None = None, seqused_q: Tensor | None = None,
                               seqused_k: Tensor | None = None, cmp_residual_k: Tensor | None = None,
                               block_table: Tensor | None = None, output_idx_offset: Tensor | None = None,
                               mask_mode: int = 0, cmp_ratio: int = 1) -> LightningIndexerV2Result:
    """:func:`lightning_indexer_v2` over int8 / fp8 e4m3 ``query`` and ``key`` with per-token-head dequantisation
    scales (quant mode 0, the one vllm-ascend uses): ``query_dequant_scale`` ``[B, S1, N1]`` / ``[T1, N1]``,
    ``key_dequant_scale`` the key's shape without D (``[.., 1]``); the score is
    ``sum_h weights[t, h] * relu(sq[t, h] * sk[j] * (query[t, h] . key[j]))``. Other quant modes raise
    ``NotImplementedError`` (their math is not public). vllm-ascend passes cumulative query lengths without a leading
    0 and uncompressed key lengths ``L``: here ``cu_seqlens_q`` takes the leading 0, ``seqused_k = L // cmp_ratio``
    and ``cmp_residual_k = L % cmp_ratio``.

    >>> q = torch.randint(-8, 8, (1, 4, 2, 16), dtype=torch.int8)
    >>> k = torch.randint(-8, 8, (1, 4, 1, 16), dtype=torch.int8)
    >>> r = quant_lightning_indexer_v2(q, k, torch.rand(1, 4, 2), torch.rand(1, 4, 2), torch.rand(1, 4, 1), topk=4)
    >>> r.sparse_indices.shape
    torch.Size([1, 4, 1, 4])
    """
    q, k, w = dequantize_indexer_inputs(query, key, weights, query_dequant_scale, key_dequant_scale,
                                        query_quant_mode=query_quant_mode, key_quant_mode=key_quant_mode)
    return lightning_indexer_v2(q, k, w, topk=topk, layout=layout, layout_key=layout_key, cu_seqlens_q=cu_seqlens_q,
                                cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
                                cmp_residual_k=cmp_residual_k, block_table=block_table,
                                output_idx_offset=output_idx_offset, mask_mode=mask_mode, cmp_ratio=cmp_ratio)
