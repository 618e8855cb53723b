"""vllm-ascend's DeepSeek-V4 ``torch.ops._C_ascend`` ops with its schemas (:data:`C_ASCEND_DSV4_OPS`, installed by
the shim): ``npu_sparse_attn_sharedkv`` (+ ``_metadata``), ``compressor`` (with RMSNorm and RoPE),
``npu_vllm_quant_lightning_indexer`` (+ ``_metadata``), ``npu_kv_quant_sparse_attn_sharedkv_metadata``, DeepSeek-V3.2's
``npu_lightning_indexer_quant`` (vllm-ascend calls it from the same device layer); and the
names whose math is not public, which raise ``NotImplementedError`` saying why.

Translation to :mod:`attnops.ops.dsv4` (no math here): ``seqused_kv`` is the ori lengths ``L``; with compressed keys
the compressed lengths are ``L // cmp_ratio`` and the residual ``L % cmp_ratio``; ``layout_kv="PA_ND"`` is
``PA_BBND`` and then ``cu_seqlens_ori_kv`` / ``cu_seqlens_cmp_kv`` are ignored (as on the NPU); ``softmax_scale``
0 means ``D ** -0.5`` and ``cmp_ratio`` <= 1 means sliding window only; ``seqused_q``, ``ori_sparse_indices`` and
``metadata`` are ignored (as vllm-ascend's build does). The indexer's ``actual_seq_lengths_query`` are cumulative
without a leading 0 (TND) or per-batch lengths (BSND); ``actual_seq_lengths_key`` the ori lengths.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.checks import caller_names, check_int, check_scale, require
from ..cann_ops_transformer.attention import lse_placeholder
from ..ops.dsv4 import api
from ..ops.dsv4.compressor_api import compressor as _compressor
from ..ops.dsv4.indexer_v2_api import quant_lightning_indexer_v2
from ..ops.dsv4.indexer_v2_quant import dequantize_indexer_inputs
from ..ops.dsv4.metadata import lightning_indexer_v2_metadata, sparse_flash_mla_metadata
from ._common import with_overloads
from .dsa import INT64_MAX, _check_window, npu_lightning_indexer

PAGED = "PA_ND"
KV_LAYOUTS = {PAGED: "PA_BBND", "BSND": "BSND", "TND": "TND"}
ATTENTION_NAMES = {"scale": "softmax_scale", "seqused_ori_kv": "seqused_kv", "cmp_residual_kv": "seqused_kv",
                   "seqused_cmp_kv": "seqused_kv"}
INDEXER_NAMES = {"topk": "sparse_count", "layout": "layout_query", "layout_q": "layout_query",
                 "layout_key": "layout_key", "layout_k": "layout_key", "mask_mode": "sparse_mode",
                 "cu_seqlens_q": "actual_seq_lengths_query", "seqused_q": "actual_seq_lengths_query",
                 "seqused_k": "actual_seq_lengths_key", "cmp_residual_k": "actual_seq_lengths_key"}


def _kv_layout(layout_kv: str) -> str:
    """vllm-ascend's kv layout name as attnops' (unknown names pass through for the core to reject)."""
    return KV_LAYOUTS.get(layout_kv, layout_kv)


def _ori_lengths(ori_kv: Tensor | None, seqused_kv: Tensor | None, cu_seqlens_ori_kv: Tensor | None,
                 layout_kv: str) -> Tensor | None:
    """Per-batch ori lengths ``L`` (None where they come from nowhere: the core then names what is missing)."""
    if seqused_kv is not None:
        return seqused_kv
    if layout_kv == "TND" and cu_seqlens_ori_kv is not None:
        return cu_seqlens_ori_kv.diff()
    if layout_kv == "BSND" and isinstance(ori_kv, Tensor) and ori_kv.dim() == 4:
        return torch.full((ori_kv.shape[0],), ori_kv.shape[1], dtype=torch.int32)
    return None


def npu_sparse_attn_sharedkv(q: Tensor, *, ori_kv: Tensor | None = None, cmp_kv: Tensor | None = None,
                             ori_sparse_indices: Tensor | None = None, cmp_sparse_indices: Tensor | None = None,
                             ori_block_table: Tensor | None = None, cmp_block_table: Tensor | None = None,
                             cu_seqlens_q: Tensor | None = None, cu_seqlens_ori_kv: Tensor | None = None,
                             cu_seqlens_cmp_kv: Tensor | None = None, seqused_q: Tensor | None = None,
                             seqused_kv: Tensor | None = None, sinks: Tensor | None = None,
                             metadata: Tensor | None = None, softmax_scale: float = 0, cmp_ratio: int = 0,
                             ori_mask_mode: int = 4, cmp_mask_mode: int = 3, ori_win_left: int = 128,
                             ori_win_right: int = 0, layout_q: str = "BSND", layout_kv: str = PAGED,
                             return_softmax_lse: bool = False) -> tuple[Tensor, Tensor]:
    """``(out, softmax_lse)``: DeepSeek-V4 attention (:func:`attnops.sparse_flash_mla`) with vllm-ascend's schema;
    ``softmax_lse`` as ops-transformer's (``[B, 1, S1, N1]`` / ``[1, T1, N1]``) with ``return_softmax_lse``, else a
    0-d fp32 placeholder."""
    scale = None if softmax_scale == 0 else check_scale("softmax_scale", softmax_scale)
    ratio = max(check_int("cmp_ratio", cmp_ratio, lo=0), 1)
    if layout_kv == PAGED:
        cu_seqlens_ori_kv = cu_seqlens_cmp_kv = None
    seqused_cmp_kv = cmp_residual_kv = None
    lengths = _ori_lengths(ori_kv, seqused_kv, cu_seqlens_ori_kv, layout_kv)
    if cmp_kv is not None and lengths is not None:
        seqused_cmp_kv, cmp_residual_kv = lengths // ratio, lengths % ratio
    with caller_names(ATTENTION_NAMES):
        out, lse = api.sparse_flash_mla(
            q, ori_kv, cmp_kv=cmp_kv, cmp_sparse_indices=cmp_sparse_indices, cmp_ratio=ratio, sinks=sinks,
            scale=scale, layout_q=layout_q, layout_kv=_kv_layout(layout_kv), ori_block_table=ori_block_table,
            cmp_block_table=cmp_block_table, cu_seqlens_q=cu_seqlens_q, cu_seqlens_ori_kv=cu_seqlens_ori_kv,
            cu_seqlens_cmp_kv=cu_seqlens_cmp_kv,
            seqused_ori_kv=seqused_kv, seqused_cmp_kv=seqused_cmp_kv, cmp_residual_kv=cmp_residual_kv,
            ori_mask_mode=ori_mask_mode, cmp_mask_mode=cmp_mask_mode, ori_win_left=ori_win_left,
            ori_win_right=ori_win_right)
    return out, (lse if return_softmax_lse else lse_placeholder(q))


def _metadata(num_heads_q, num_heads_kv, head_dim, cu_seqlens_q, cu_seqlens_ori_kv, cu_seqlens_cmp_kv, seqused_q,
              seqused_kv, batch_size, max_seqlen_q, max_seqlen_kv, ori_topk, cmp_topk, cmp_ratio, ori_mask_mode,
              cmp_mask_mode, ori_win_left, ori_win_right, layout_q, layout_kv, has_ori_kv, has_cmp_kv,
              device) -> Tensor:
    """The attention metadata of both sharedkv ops (int32 ``[1024]`` zeros, no math); ``batch_size`` 0: unknown."""
    require(isinstance(device, str), "device", "a device name (str)", device)
    with caller_names({"seqused_ori_kv": "seqused_kv", "max_seqlen_ori_kv": "max_seqlen_kv"}):
        return sparse_flash_mla_metadata(
            num_heads_q, num_heads_kv, head_dim, cu_seqlens_q=cu_seqlens_q, cu_seqlens_ori_kv=cu_seqlens_ori_kv,
            cu_seqlens_cmp_kv=cu_seqlens_cmp_kv, seqused_q=seqused_q, seqused_ori_kv=seqused_kv,
            batch_size=batch_size or None, max_seqlen_q=max_seqlen_q, max_seqlen_ori_kv=max_seqlen_kv,
            ori_topk=ori_topk, cmp_topk=cmp_topk, cmp_ratio=max(check_int("cmp_ratio", cmp_ratio), 1),
            ori_mask_mode=ori_mask_mode, cmp_mask_mode=cmp_mask_mode, ori_win_left=ori_win_left,
            ori_win_right=ori_win_right, layout_q=layout_q, layout_kv=_kv_layout(layout_kv), has_ori_kv=has_ori_kv,
            has_cmp_kv=has_cmp_kv)


def npu_sparse_attn_sharedkv_metadata(num_heads_q: int, num_heads_kv: int, head_dim: int,
                                      cu_seqlens_q: Tensor | None = None, cu_seqlens_ori_kv: Tensor | None = None,
                                      cu_seqlens_cmp_kv: Tensor | None = None, seqused_q: Tensor | None = None,
                                      seqused_kv: Tensor | None = None, batch_size: int = 0, max_seqlen_q: int = 0,
                                      max_seqlen_kv: int = 0, ori_topk: int = 0, cmp_topk: int = 0,
                                      cmp_ratio: int = 4, ori_mask_mode: int = 4, cmp_mask_mode: int = 3,
                                      ori_win_left: int = 128, ori_win_right: int = 0, layout_q: str = "BSND",
                                      layout_kv: str = PAGED, has_ori_kv: bool = True, has_cmp_kv: bool = True,
                                      device: str = "npu") -> Tensor:
    """int32 ``[1024]`` zeros on the length tensors' device (the CPU without them) after checking the arguments;
    ``device`` names the NPU the kernel would run on and is not used."""
    return _metadata(num_heads_q, num_heads_kv, head_dim, cu_seqlens_q, cu_seqlens_ori_kv, cu_seqlens_cmp_kv,
                     seqused_q, seqused_kv, batch_size, max_seqlen_q, max_seqlen_kv, ori_topk, cmp_topk, cmp_ratio,
                     ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right, layout_q, layout_kv, has_ori_kv,
                     has_cmp_kv, device)


def npu_kv_quant_sparse_attn_sharedkv_metadata(num_heads_q: int, num_heads_kv: int, head_dim: int,
                                               kv_quant_mode: int, cu_seqlens_q: Tensor | None = None,
                                               cu_seqlens_ori_kv: Tensor | None = None,
                                               cu_seqlens_cmp_kv: Tensor | None = None,
                                               seqused_q: Tensor | None = None, seqused_kv: Tensor | None = None,
                                               batch_size: int = 0, max_seqlen_q: int = 0, max_seqlen_kv: int = 0,
                                               ori_topk: int = 0, cmp_topk: int = 0, tile_size: int = 0,
                                               rope_head_dim: int = 0, cmp_ratio: int = -1, ori_mask_mode: int = 4,
                                               cmp_mask_mode: int = 3, ori_win_left: int = 127,
                                               ori_win_right: int = 0, layout_q: str = "BSND",
                                               layout_kv: str = PAGED, has_ori_kv: bool = True,
                                               has_cmp_kv: bool = True, device: str = "npu") -> Tensor:
    """The quantised-KV attention's metadata: as :func:`npu_sparse_attn_sharedkv_metadata` (``kv_quant_mode``,
    ``tile_size`` and ``rope_head_dim`` are checked to be ints; the metadata carries no math)."""
    for name, value in (("kv_quant_mode", kv_quant_mode), ("tile_size", tile_size), ("rope_head_dim", rope_head_dim)):
        check_int(name, value, lo=0)
    return _metadata(num_heads_q, num_heads_kv, head_dim, cu_seqlens_q, cu_seqlens_ori_kv, cu_seqlens_cmp_kv,
                     seqused_q, seqused_kv, batch_size, max_seqlen_q, max_seqlen_kv, ori_topk, cmp_topk, cmp_ratio,
                     ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right, layout_q, layout_kv, has_ori_kv,
                     has_cmp_kv, device)


def compressor(x: Tensor, wkv: Tensor, wgate: Tensor, state_cache: Tensor, ape: Tensor, norm_weight: Tensor,
               rope_sin: Tensor, rope_cos: Tensor, state_block_table: Tensor | None, cu_seqlens: Tensor | None,
               seqused: Tensor | None, start_pos: Tensor | None, rope_head_dim: int, cmp_ratio: int, coff: int,
               norm_eps: float, rotary_mode: int, cache_mode: int) -> Tensor:
    """vllm-ascend's compressor: :func:`attnops.compressor` followed by RMSNorm (``norm_weight``, ``norm_eps``) and
    RoPE of the last ``rope_head_dim`` columns of each row; ``state_cache`` is updated in place."""
    return _compressor(x, wkv, wgate, state_cache, ape, cmp_ratio=cmp_ratio, coff=coff,
                       state_block_table=state_block_table, cu_seqlens=cu_seqlens, seqused=seqused,
                       start_pos=start_pos, cache_mode=cache_mode, norm_weight=norm_weight, rope_sin=rope_sin,
                       rope_cos=rope_cos, rope_head_dim=rope_head_dim, norm_eps=norm_eps, rotary_mode=rotary_mode)


def _query_lengths(actual_seq_lengths_query: Tensor | None, layout_query: str) -> dict[str, Tensor | None]:
    """TND: cumulative ends without the leading 0 -> ``cu_seqlens_q``; BSND: per-batch lengths -> ``seqused_q``."""
    if actual_seq_lengths_query is None:
        return {}
    if layout_query == "TND":
        ends = torch.as_tensor(actual_seq_lengths_query)
        return {"cu_seqlens_q": torch.cat([ends.new_zeros(1), ends])}
    return {"seqused_q": actual_seq_lengths_query}


def npu_vllm_quant_lightning_indexer(query: Tensor, key: Tensor, weights: Tensor, query_dequant_scale: Tensor,
                                     key_dequant_scale: Tensor, query_quant_mode: int = 0, key_quant_mode: int = 0,
                                     actual_seq_lengths_query: Tensor | None = None,
                                     actual_seq_lengths_key: Tensor | None = None, block_table: Tensor | None = None,
                                     metadata: Tensor | None = None, layout_query: str = "BSND",
                                     layout_key: str = "BSND", sparse_count: int = 2048, sparse_mode: int = 3,
                                     pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX, cmp_ratio: int = 1,
                                     return_value: bool = False) -> tuple[Tensor, Tensor]:
    """``(sparse_indices, sparse_values)``: :func:`attnops.quant_lightning_indexer_v2` with vllm-ascend's schema
    (``actual_seq_lengths_key`` are the ori lengths ``L``: ``L // cmp_ratio`` compressed keys, residual
    ``L % cmp_ratio``); ``sparse_values`` is an empty fp32 ``[0]`` unless ``return_value``."""
    _check_window(pre_tokens, next_tokens)
    ratio = check_int("cmp_ratio", cmp_ratio, lo=1)
    keys = {}
    if actual_seq_lengths_key is not None:
        lengths = torch.as_tensor(actual_seq_lengths_key)
        keys = {"seqused_k": lengths // ratio, "cmp_residual_k": lengths % ratio}
    with caller_names(INDEXER_NAMES):
        idx, values = quant_lightning_indexer_v2(
            query, key, weights, query_dequant_scale, key_dequant_scale, topk=sparse_count,
            query_quant_mode=query_quant_mode, key_quant_mode=key_quant_mode, layout=layout_query,
            layout_key=layout_key, block_table=block_table, mask_mode=sparse_mode, cmp_ratio=ratio,
            **_query_lengths(actual_seq_lengths_query, layout_query), **keys)
    return idx, (values if return_value else values.new_empty((0,)))


def npu_vllm_quant_lightning_indexer_metadata(num_heads_q: int, num_heads_k: int, head_dim: int,
                                              query_quant_mode: int, key_quant_mode: int,
                                              actual_seq_lengths_query: Tensor | None = None,
                                              actual_seq_lengths_key: Tensor | None = None, batch_size: int = 0,
                                              max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                                              layout_query: str = "BSND", layout_key: str = "BSND",
                                              sparse_count: int = 2048, sparse_mode: int = 3,
                                              pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
                                              cmp_ratio: int = 1, device: str = "npu") -> Tensor:
    """The quantised indexer's metadata: int32 ``[1024]`` zeros after checking the arguments (no math)."""
    _check_window(pre_tokens, next_tokens)
    require(isinstance(device, str), "device", "a device name (str)", device)
    for name, value in (("query_quant_mode", query_quant_mode), ("key_quant_mode", key_quant_mode)):
        check_int(name, value, lo=0)
    with caller_names(INDEXER_NAMES):
        return lightning_indexer_v2_metadata(
            num_heads_q, num_heads_k, head_dim, sparse_count, seqused_q=actual_seq_lengths_query,
            seqused_k=actual_seq_lengths_key, batch_size=batch_size or None, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, layout_q=layout_query, layout_k=layout_key, mask_mode=sparse_mode,
            cmp_ratio=cmp_ratio)


def npu_lightning_indexer_quant(query: Tensor, key: Tensor, weights: Tensor, query_dequant_scale: Tensor,
                                key_dequant_scale: Tensor, *, actual_seq_lengths_query: Tensor | None = None,
                                actual_seq_lengths_key: Tensor | None = None, block_table: Tensor | None = None,
                                query_quant_mode: int = 0, key_quant_mode: int = 0, layout_query: str = "BSND",
                                layout_key: str = "BSND", sparse_count: int = 2048, sparse_mode: int = 3) -> Tensor:
    """``sparse_indices``: DeepSeek-V3.2's lightning indexer (:func:`attnops.torch_npu.npu_lightning_indexer`, the
    same lengths and layouts) over int8 / fp8 codes with per-token-head dequantisation scales (quant mode 0)."""
    q, k, w = dequantize_indexer_inputs(query, key, weights, query_dequant_scale, key_dequant_scale,
                                        query_quant_mode=query_quant_mode, key_quant_mode=key_quant_mode)
    return npu_lightning_indexer(q, k, w, actual_seq_lengths_query=actual_seq_lengths_query,
                                 actual_seq_lengths_key=actual_seq_lengths_key, block_table=block_table,
                                 layout_query=layout_query, layout_key=layout_key, sparse_count=sparse_count,
                                 sparse_mode=sparse_mode)[0]


def _not_public(name: str, reason: str):
    """An op vllm-ascend calls whose math is not public: registered, raising ``NotImplementedError``."""
    def op(*args, **kwargs):
        raise NotImplementedError(f"torch.ops._C_ascend.{name}: {reason}; attnops does not implement it")

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"Not implemented: {reason}."
    return op


_PACKED_ROW = "the byte layout of its packed FP8 rows and scales is only in Ascend kernel code, not public"
NOT_PUBLIC = {
    "npu_kv_quant_sparse_attn_sharedkv": "its KV cache rows are written by kv_compress_epilog, and "
                                         + _PACKED_ROW,
    "kv_compress_epilog": _PACKED_ROW,
    "indexer_compress_epilog_v2": _PACKED_ROW,
    "compressor_metadata": "its slot-mapping formats and rope row selection are not documented publicly",
    "inplace_partial_rotary_mul": "its rotary_mode strings and partial_slice semantics are not documented publicly",
}

# name -> function, for torch.ops._C_ascend once the shim is installed
C_ASCEND_DSV4_OPS = {
    "npu_sparse_attn_sharedkv": with_overloads(npu_sparse_attn_sharedkv),
    "npu_sparse_attn_sharedkv_metadata": with_overloads(npu_sparse_attn_sharedkv_metadata),
    "npu_kv_quant_sparse_attn_sharedkv_metadata": with_overloads(npu_kv_quant_sparse_attn_sharedkv_metadata),
    "compressor": with_overloads(compressor),
    "npu_vllm_quant_lightning_indexer": with_overloads(npu_vllm_quant_lightning_indexer),
    "npu_vllm_quant_lightning_indexer_metadata": with_overloads(npu_vllm_quant_lightning_indexer_metadata),
    "npu_lightning_indexer_quant": with_overloads(npu_lightning_indexer_quant),
    **{name: with_overloads(_not_public(name, reason)) for name, reason in NOT_PUBLIC.items()},
}
