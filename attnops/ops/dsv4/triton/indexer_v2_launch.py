"""Host side of the DeepSeek-V4 lightning indexer's kernel: the layouts as strides, the grid and the outputs, as a
plan ``(outputs, [Launch])`` (also compiled by ``python -m attnops aot``). Nothing is read back from the device: the
metadata tensors (device tensors, or host ones uploaded by the caller) are read by the kernel, which clamps every
length into the tensors and writes every output element (padding rows: -1 / -inf), so the plan never synchronises
and a CUDA graph can capture it. Arguments are validated by the operator before they get here."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...._core.triton.launch import Launch, pow2, unit_last_stride
from ...._core.triton.support import interpreting, precision_flags
from .indexer_v2_family import KERNELS

KV_MODES = {"BSND": 0, "TND": 1, "PA_BBND": 2, "PA_BSND": 2}


@dataclass(frozen=True)
class IndexerV2Metadata:
    """The call's metadata tensors on the query's device (None where not given)."""
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    seqused_q: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None
    cmp_residual_k: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    output_idx_offset: torch.Tensor | None = None


def lead_strides(x: torch.Tensor, packed: bool, count: int) -> tuple[int, ...]:
    """The first ``count`` strides of ``x`` as ``(batch, token, ...)``: a packed ``[T, ...]`` tensor has batch stride
    0."""
    strides = (0, *x.stride()) if packed else x.stride()
    return tuple(strides[:count])


def indexer_v2_plan(query: torch.Tensor, key: torch.Tensor, weights: torch.Tensor, meta: IndexerV2Metadata, topk: int,
                    layout_q: str, layout_k: str, mask_mode: int, cmp_ratio: int, interpret: bool):
    """``((sparse_indices int32, sparse_values fp32), launches)``, both ``[B, S1, 1, topk]`` / ``[T1, 1, topk]``."""
    q, k, w = (unit_last_stride(x) for x in (query, key, weights))
    packed, mode = layout_q == "TND", KV_MODES[layout_k]
    shape = (*q.shape[:-2], 1, topk)
    indices = torch.empty(shape, dtype=torch.int32, device=q.device)
    values = torch.empty(shape, dtype=torch.float32, device=q.device)
    if indices.numel() == 0:
        return (indices, values), []
    n_batch = meta.cu_seqlens_q.shape[0] - 1 if packed else q.shape[0]
    table = meta.block_table
    page = k.shape[1] if mode == 2 else 1
    s2 = (k.shape[1], k.shape[0], table.shape[1] * page if table is not None else 0)[mode]
    spare = indices
    q_ends = meta.cu_seqlens_q[1:] if packed else spare
    k_ends = meta.cu_seqlens_k[1:] if mode == 1 else spare
    pointers = [x if x is not None else spare for x in (meta.seqused_q, meta.seqused_k, meta.cmp_residual_k,
                                                         table, meta.output_idx_offset)]
    sq, sk, res, bt, off = pointers
    off_strides = lead_strides(off, packed, 2) if meta.output_idx_offset is not None else (0, 0)
    k_strides = (0, k.stride(0)) if mode == 1 else (k.stride(0), k.stride(1))
    args = (q, k, w, indices, values, off, q_ends, sq, k_ends, sk, res, bt, *lead_strides(q, packed, 3), *k_strides,
            *lead_strides(w, packed, 3), *lead_strides(indices, packed, 2), *off_strides,
            table.stride(0) if table is not None else 0, q.shape[0] if packed else q.shape[1], s2, n_batch,
            q.shape[-2], q.shape[-1], page, k.shape[0] if mode == 2 else 1, topk, cmp_ratio)
    causal = mask_mode == 3
    constexprs = dict(Q_PACKED=packed, SEQUSED_Q=meta.seqused_q is not None, KV_MODE=mode,
                      SEQUSED_K=meta.seqused_k is not None, CAUSAL=causal,
                      RESIDUAL=causal and meta.cmp_residual_k is not None,
                      OFFSET=meta.output_idx_offset is not None, BLOCK_H=pow2(q.shape[-2]), BLOCK_D=pow2(q.shape[-1]),
                      **precision_flags(q.dtype, interpret))
    grid = (q.shape[0], 1) if packed else (q.shape[1], q.shape[0])
    return (indices, values), [Launch("indexer_v2_kernel", grid, args, constexprs)]


def lightning_indexer_v2(query, key, weights, meta: IndexerV2Metadata, topk: int, layout_q: str, layout_k: str,
                         mask_mode: int, cmp_ratio: int):
    """Runs :func:`indexer_v2_plan`; returns ``(sparse_indices, sparse_values)``."""
    outputs, launches = indexer_v2_plan(query, key, weights, meta, topk, layout_q, layout_k, mask_mode, cmp_ratio,
                                        interpreting(query.device))
    KERNELS.run_all(launches, query.device)
    return outputs
