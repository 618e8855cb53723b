"""torch_npu's DeepSeek sparse attention ops (``npu_lightning_indexer``, ``npu_sparse_flash_attention``,
``npu_kv_quant_sparse_flash_attention``, ``npu_sparse_lightning_indexer_grad_kl_loss``) with op-plugin's schemas,
and vllm-ascend's ``torch.ops._C_ascend`` twins of the first three (:data:`C_ASCEND_OPS`, installed by the shim).

They call the ``attnops::dsa_*`` custom ops (fake kernels, autograd for sparse attention) and add the NPU's own
limits: one kv head, head dims 128 (indexer), 512 + 64 rope (sparse attention, KL loss), ``attention_mode`` 2,
``pre_tokens``/``next_tokens`` at their defaults, no ``return_softmax_lse`` / ``return_value`` with a paged cache.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.checks import check_scale, require
from .._core.errors import ParamDtypeError
from .._core.hifloat8 import HIFLOAT8
from .._core.custom_ops import call
from ..ops.dsa import op as dsa_op
from ._common import with_overloads

INT64_MAX = 2**63 - 1
INDEXER_DIM = 128
LATENT_DIM = 512
ROPE_DIM = 64
SPARSE_COUNTS = (*range(1, 2049), 3072, 4096, 5120, 6144, 7168, 8192)
MLA_ABSORB = 2
HIF8_SPARSE_COUNT = 2048


def _check_window(pre_tokens: int, next_tokens: int) -> None:
    for name, value in (("pre_tokens", pre_tokens), ("next_tokens", next_tokens)):
        require(value == INT64_MAX, name, f"{INT64_MAX} (the only value the NPU supports; the causal rule comes "
                                          "from sparse_mode)", value)


def _check_dim(name: str, x: Tensor | None, d: int) -> None:
    if x is not None:
        require(x.shape[-1] == d, name, f"head dim {d} (the NPU's)", x)


def _empty(query: Tensor) -> Tensor:
    return query.new_empty((0,), dtype=torch.float32)


def npu_lightning_indexer(query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                          block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3,
                          pre_tokens=INT64_MAX, next_tokens=INT64_MAX, return_value=False):
    """``(sparse_indices [B, S1, 1, K] / [T1, 1, K] int32, sparse_values (same shape; [0] unless return_value))``:
    the top ``sparse_count`` key positions per query token, most relevant first, -1 padded."""
    _check_window(pre_tokens, next_tokens)
    _check_dim("query", query, INDEXER_DIM)
    require(sparse_count in SPARSE_COUNTS, "sparse_count", "1..2048 or 3072/4096/5120/6144/7168/8192", sparse_count)
    return call(dsa_op.dsa_lightning_indexer, query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key,
                block_table, layout_query, layout_key, sparse_count, sparse_mode, return_value)


def npu_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, block_table=None,
                               actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                               key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                               sparse_mode=3, pre_tokens=INT64_MAX, next_tokens=INT64_MAX, attention_mode=0,
                               return_softmax_lse=False, sinks=None):
    """``(attention_out, softmax_max, softmax_sum)``; the statistics ``[B, 1, S1, N1]`` / ``[1, T1, N1]`` fp32 when
    ``return_softmax_lse`` (training), else empty ``[0]``. Differentiable in query, key, value and the rope parts."""
    _check_window(pre_tokens, next_tokens)
    require(attention_mode == MLA_ABSORB, "attention_mode", "2 (MLA-absorb, the only mode the NPU runs)",
            attention_mode)
    for name, x, d in (("query", query, LATENT_DIM), ("query_rope", query_rope, ROPE_DIM)):
        _check_dim(name, x, d)
    require(not (return_softmax_lse and layout_kv == "PA_BSND"), "return_softmax_lse",
            "False with layout_kv 'PA_BSND' (the NPU returns the statistics for non-paged keys only)",
            return_softmax_lse)
    out, m, l = call(dsa_op.dsa_sparse_flash_attention, query, key, value, sparse_indices, query_rope, key_rope,
                     sinks, block_table, actual_seq_lengths_query, actual_seq_lengths_kv,
                     check_scale("scale_value", scale_value), sparse_block_size, layout_query, layout_kv, sparse_mode)
    return (out, m, l) if return_softmax_lse else (out, _empty(query), _empty(query))


def npu_kv_quant_sparse_flash_attention(query, key, value, sparse_indices, scale_value, key_quant_mode,
                                        value_quant_mode, *, key_dequant_scale=None, value_dequant_scale=None,
                                        block_table=None, actual_seq_lengths_query=None, actual_seq_lengths_kv=None,
                                        sparse_block_size=1, layout_query="BSND", layout_kv="BSND", sparse_mode=3,
                                        pre_tokens=INT64_MAX, next_tokens=INT64_MAX, attention_mode=0,
                                        quant_scale_repo_mode=1, tile_size=128, rope_head_dim=64, key_dtype=None,
                                        value_dtype=None, sinks=None):
    """``attention_out [.., N1, 512]`` of query ``[.., N1, 576]`` over packed 656-byte int8/fp8 cache rows (per-128-
    tile scales stored in each row). ``key_dtype=torch_npu.hifloat8``: the codes are HiFloat8 bytes (a uint8 or int8
    cache); ``value_dtype`` is then None or the same (the value is the key's dequantized nope part either way)."""
    hif8 = _is_hifloat8(key_dtype, value_dtype)
    return _quant_attention(query, key, value, sparse_indices, scale_value, key_quant_mode, value_quant_mode,
                            key_dequant_scale, value_dequant_scale, block_table, actual_seq_lengths_query,
                            actual_seq_lengths_kv, sparse_block_size, layout_query, layout_kv, sparse_mode, pre_tokens,
                            next_tokens, attention_mode, quant_scale_repo_mode, tile_size, rope_head_dim, sinks,
                            hif8)[0]


def _is_hifloat8(key_dtype, value_dtype) -> bool:
    """Whether ``key_dtype`` names HiFloat8 (None: the key tensor's own dtype)."""
    for name, x in (("key_dtype", key_dtype), ("value_dtype", value_dtype)):
        if x is not None and x is not HIFLOAT8:
            raise ParamDtypeError(f"{name}: expected None or torch_npu.hifloat8 (the only dtype the NPU takes here), "
                                  f"got {x!r}")
    if value_dtype is not None and key_dtype is None:
        raise ParamDtypeError("value_dtype: expected None unless key_dtype is torch_npu.hifloat8 (value and key "
                              "share the packed cache), got torch_npu.hifloat8 with key_dtype None")
    return key_dtype is HIFLOAT8


def _quant_attention(query, key, value, sparse_indices, scale_value, key_quant_mode, value_quant_mode,
                     key_dequant_scale, value_dequant_scale, block_table, actual_seq_lengths_query,
                     actual_seq_lengths_kv, sparse_block_size, layout_query, layout_kv, sparse_mode, pre_tokens,
                     next_tokens, attention_mode, quant_scale_repo_mode, tile_size, rope_head_dim, sinks, hif8=False):
    _check_window(pre_tokens, next_tokens)
    if hif8:
        require(isinstance(sparse_indices, Tensor) and sparse_indices.dim() > 0
                and sparse_indices.shape[-1] == HIF8_SPARSE_COUNT, "sparse_indices",
                f"last dim {HIF8_SPARSE_COUNT} with a HiFloat8 cache (the only count the NPU supports)",
                sparse_indices)
    for name, value_, allowed in (("key_quant_mode", key_quant_mode, 2), ("value_quant_mode", value_quant_mode, 2),
                                  ("quant_scale_repo_mode", quant_scale_repo_mode, 1), ("tile_size", tile_size, 128),
                                  ("attention_mode", attention_mode, MLA_ABSORB)):
        require(value_ == allowed, name, f"{allowed} (the only value the NPU supports)", value_)
    for name, x in (("key_dequant_scale", key_dequant_scale), ("value_dequant_scale", value_dequant_scale)):
        require(x is None, name, "None (the scales are stored in each packed row)", x)
    return call(dsa_op.dsa_kv_quant_sparse_flash_attention, query, key, value, sparse_indices, sinks, block_table,
                actual_seq_lengths_query, actual_seq_lengths_kv, check_scale("scale_value", scale_value),
                sparse_block_size, layout_query, layout_kv, sparse_mode, rope_head_dim, hif8)


def npu_sparse_lightning_indexer_grad_kl_loss(query, key, query_index, key_index, weights, sparse_indices,
                                              softmax_max, softmax_sum, scale_value, *, query_rope=None,
                                              key_rope=None, actual_seq_qlen=None, actual_seq_klen=None,
                                              layout="BSND", sparse_mode=3, pre_tokens=INT64_MAX,
                                              next_tokens=INT64_MAX, sinks=None):
    """``(d_query_index, d_key_index, d_weights, loss [1] fp32)``: the indexer's summed KL loss against the main
    attention's distribution and its gradients (``pre_tokens``/``next_tokens`` are ignored, as on the NPU)."""
    if sinks is not None:
        raise NotImplementedError("sinks: the KL loss with sinks is not specified by CANN's sources; attnops does "
                                  "not implement it (expected None)")
    for name, x, d in (("query", query, LATENT_DIM), ("query_rope", query_rope, ROPE_DIM),
                       ("query_index", query_index, INDEXER_DIM)):
        _check_dim(name, x, d)
    return call(dsa_op.dsa_indexer_kl_loss_grad, query, key, query_index, key_index, weights, sparse_indices,
                softmax_max, softmax_sum, query_rope, key_rope, check_scale("scale_value", scale_value),
                _lengths(actual_seq_qlen), _lengths(actual_seq_klen), layout, sparse_mode)


def _lengths(x) -> Tensor | None:
    """torch_npu's ``int[]`` lengths (or an int tensor) as the op takes them: a CPU int64 tensor."""
    return None if x is None else torch.tensor([int(v) for v in x], dtype=torch.int64)


# ---------------------------------------------------------------- vllm-ascend's torch.ops._C_ascend twins
def _c_ascend_lightning_indexer(*args, **kwargs):
    """vllm-ascend's twin: the same schema as :func:`npu_lightning_indexer`."""
    return npu_lightning_indexer(*args, **kwargs)


def _c_ascend_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, block_table=None,
                                     actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                                     key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                                     sparse_mode=3, pre_tokens=INT64_MAX, next_tokens=INT64_MAX, attention_mode=2,
                                     return_softmax_lse=False):
    """vllm-ascend's twin: ``attention_mode`` defaults to 2, no ``sinks``."""
    return npu_sparse_flash_attention(
        query, key, value, sparse_indices, scale_value, block_table=block_table,
        actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_kv=actual_seq_lengths_kv,
        query_rope=query_rope, key_rope=key_rope, sparse_block_size=sparse_block_size, layout_query=layout_query,
        layout_kv=layout_kv, sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens,
        attention_mode=attention_mode, return_softmax_lse=return_softmax_lse)


def _c_ascend_kv_quant_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, key_quant_mode=1,
                                              value_quant_mode=1, key_dequant_scale=None, value_dequant_scale=None,
                                              block_table=None, actual_seq_lengths_query=None,
                                              actual_seq_lengths_kv=None, sparse_block_size=1, layout_query="BSND",
                                              layout_kv="BSND", sparse_mode=3, pre_tokens=INT64_MAX,
                                              next_tokens=INT64_MAX, attention_mode=0, quant_scale_repo_mode=1,
                                              tile_size=128, rope_head_dim=64, return_softmax_lse=False):
    """vllm-ascend's twin: keyword quant modes, and ``(out, softmax_max, softmax_sum)``."""
    out, m, l = _quant_attention(query, key, value, sparse_indices, scale_value, key_quant_mode, value_quant_mode,
                                 key_dequant_scale, value_dequant_scale, block_table, actual_seq_lengths_query,
                                 actual_seq_lengths_kv, sparse_block_size, layout_query, layout_kv, sparse_mode,
                                 pre_tokens, next_tokens, attention_mode, quant_scale_repo_mode, tile_size,
                                 rope_head_dim, None)
    return (out, m, l) if return_softmax_lse else (out, _empty(query), _empty(query))


# name -> function, for torch.ops._C_ascend once the shim is installed
C_ASCEND_OPS = {
    "npu_lightning_indexer": with_overloads(_c_ascend_lightning_indexer),
    "npu_sparse_flash_attention": with_overloads(_c_ascend_sparse_flash_attention),
    "npu_kv_quant_sparse_flash_attention": with_overloads(_c_ascend_kv_quant_sparse_flash_attention),
}

__all__ = ["npu_kv_quant_sparse_flash_attention", "npu_lightning_indexer", "npu_sparse_flash_attention",
           "npu_sparse_lightning_indexer_grad_kl_loss"]
