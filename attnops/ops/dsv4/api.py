"""Pythonic DeepSeek-V4 sparse flash MLA: the attention (differentiable), its backward as a function, and the
metadata functions (no math). No math here: validation and dispatch happen in the custom ops (:mod:`.op`)."""
from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from ..._core.checks import caller_names, check_head_dim, check_scale, check_tensor
from ..._core.custom_ops import call
from . import op

QueryLayout = Literal["BSND", "TND"]
KvLayout = Literal["BSND", "TND", "PA_BBND"]
# the grad op's schema names of its own inputs -> this API's (the op's device check names the schema's)
GRAD_OP_NAMES = {"dout": "d_out", "dlse": "d_softmax_lse", "out": "attn_out", "lse": "softmax_lse"}


def _int_tensor(x) -> Tensor | None:
    """Lengths as the ops take them: an int tensor (lists become CPU int32 tensors)."""
    return torch.tensor(list(x), dtype=torch.int32) if isinstance(x, (list, tuple)) else x


class SparseFlashMlaResult(NamedTuple):
    """``attn_out`` (q's shape and dtype) and ``softmax_lse`` (fp32, fp64 for fp64 inputs; ``[B, 1, S1, N1]`` for a
    BSND q, ``[1, T1, N1]`` for TND; the sink is included; 0 for rows that see no key and padding rows)."""
    attn_out: Tensor
    softmax_lse: Tensor


class SparseFlashMlaGradResult(NamedTuple):
    """Gradients of :func:`sparse_flash_mla` (None where the input is absent) and ``cmp_softmax_l1_norm``: per entry
    of ``cmp_sparse_indices`` (its shape; fp32, fp64 for fp64 inputs), the attention probability of its key summed
    over the query heads (0 for entries that do not count); ``ori_softmax_l1_norm`` is always None (the ori branch
    takes no indices)."""
    d_q: Tensor
    d_ori_kv: Tensor
    d_cmp_kv: Tensor | None
    d_sinks: Tensor | None
    ori_softmax_l1_norm: Tensor | None
    cmp_softmax_l1_norm: Tensor | None


def _scale(scale, q) -> float:
    """``scale`` checked, or ``D ** -0.5``."""
    if scale is not None:
        return check_scale("scale", scale)
    check_tensor("q", q, ndim=(3, 4))
    check_head_dim("q", q, q.shape[-1])
    return q.shape[-1] ** -0.5


def _arguments(q, ori_kv, cmp_kv, cmp_sparse_indices, ori_block_table, cmp_block_table, cu_seqlens_q,
               cu_seqlens_ori_kv, cu_seqlens_cmp_kv, seqused_q, seqused_ori_kv, seqused_cmp_kv, cmp_residual_kv, sinks,
               scale, cmp_ratio, ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right, layout_q, layout_kv
               ) -> tuple:
    """The custom ops' arguments in schema order (lists as int32 tensors, the default scale filled in)."""
    ints = [_int_tensor(x) for x in (cu_seqlens_q, cu_seqlens_ori_kv, cu_seqlens_cmp_kv, seqused_q, seqused_ori_kv,
                                     seqused_cmp_kv, cmp_residual_kv)]
    return (q, ori_kv, cmp_kv, cmp_sparse_indices, ori_block_table, cmp_block_table, *ints, sinks,
            _scale(scale, q), cmp_ratio, ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right, layout_q,
            layout_kv)


def sparse_flash_mla(q: Tensor, ori_kv: Tensor, *, cmp_kv: Tensor | None = None,
                     cmp_sparse_indices: Tensor | None = None, cmp_ratio: int = 1, sinks: Tensor | None = None,
                     scale: float | None = None, layout_q: QueryLayout = "BSND", layout_kv: KvLayout = "BSND",
                     ori_block_table: Tensor | None = None, cmp_block_table: Tensor | None = None,
                     cu_seqlens_q=None, cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None, seqused_q=None,
                     seqused_ori_kv=None, seqused_cmp_kv=None, cmp_residual_kv=None, ori_mask_mode: int = 4,
                     cmp_mask_mode: int = 3, ori_win_left: int = 127, ori_win_right: int = 0) -> SparseFlashMlaResult:
    """DeepSeek-V4 attention: each query row attends, under one softmax with an optional per-head sink logit, to a
    sliding window of the uncompressed keys ``ori_kv`` and to compressed keys ``cmp_kv`` (all those its position has
    completed: HCA; or those its ``cmp_sparse_indices`` row lists: CSA). Keys are values (shared KV).

    Shapes: q ``[B, S1, N1, D]`` (``layout_q="BSND"``) or ``[T1, N1, D]`` (``"TND"``, with ``cu_seqlens_q [B+1]``);
    ``ori_kv`` / ``cmp_kv`` ``[B, S, 1, D]`` (BSND), ``[T, 1, D]`` (TND, with ``cu_seqlens_ori_kv`` /
    ``cu_seqlens_cmp_kv``) or a paged cache ``[blocks, block_size, 1, D]`` (``layout_kv="PA_BBND"``, with
    ``ori_block_table`` / ``cmp_block_table [B, max_blocks]`` and ``seqused_ori_kv``); ``cmp_sparse_indices`` int32
    ``[B, S1, 1, K]`` / ``[T1, 1, K]``: compressed positions within the batch, -1 padded; ``sinks [N1]`` fp32.
    Lengths (int tensors or lists): ``cu_seqlens_*`` prefix sums with a leading 0; ``seqused_* [B]`` override them
    (``seqused_cmp_kv`` of a paged cache defaults to ``(Lori - residual) // cmp_ratio``); ``cmp_residual_kv [B]``
    (each ``< cmp_ratio``): the ori tokens past the last compressed block, so the compressed mask counts from
    ``Lcmp * cmp_ratio + residual`` ori tokens (``Lori`` without it).

    Query row ``i`` of a batch with ``Lq`` rows sits at ori position ``p = Lori - Lq + i``. Ori keys: mask mode 4
    (default) ``[p - ori_win_left, p + ori_win_right]`` (127/0: the 128 latest tokens including ``p``), mode 3
    ``[0, p + ori_win_right]``, mode 0 all; a window of -1 is unbounded. Compressed keys (cmp mask mode 3): ``c <
    floor((Lcm - Lq + i + 1) / cmp_ratio)`` (the blocks of ``cmp_ratio`` tokens that end at or before ``p``); mode 0:
    all ``floor(Lcm / cmp_ratio)``. With indices, only the first ``min(K, that count)`` entries up to the first -1
    count, those below the count (duplicates count twice). ``scale`` (default ``D ** -0.5``) multiplies ``q . k``.

    Returns ``(attn_out, softmax_lse)`` (:class:`SparseFlashMlaResult`). A row that sees no key (and a padding row
    past ``seqused_q``) gives 0 in both, sinks or not. Differentiable in q, ori_kv, cmp_kv and sinks; memory is
    linear in the sequence length.

    >>> q, swa = torch.randn(1, 16, 4, 32), torch.randn(1, 16, 1, 32)
    >>> cmp = torch.randn(1, 4, 1, 32)                        # 16 tokens compressed by 4
    >>> out, lse = sparse_flash_mla(q, swa, cmp_kv=cmp, cmp_ratio=4, ori_win_left=7, sinks=torch.zeros(4))
    >>> out.shape, lse.shape
    (torch.Size([1, 16, 4, 32]), torch.Size([1, 1, 16, 4]))
    """
    out, lse = call(op.dsv4_sparse_flash_mla, *_arguments(
        q, ori_kv, cmp_kv, cmp_sparse_indices, ori_block_table, cmp_block_table, cu_seqlens_q, cu_seqlens_ori_kv,
        cu_seqlens_cmp_kv, seqused_q, seqused_ori_kv, seqused_cmp_kv, cmp_residual_kv, sinks, scale, cmp_ratio,
        ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right, layout_q, layout_kv))
    return SparseFlashMlaResult(out, lse)


def sparse_flash_mla_grad(q: Tensor, ori_kv: Tensor, d_out: Tensor, attn_out: Tensor, softmax_lse: Tensor, *,
                          d_softmax_lse: Tensor | None = None, cmp_kv: Tensor | None = None,
                          cmp_sparse_indices: Tensor | None = None, cmp_ratio: int = 1, sinks: Tensor | None = None,
                          scale: float | None = None, layout_q: QueryLayout = "BSND", layout_kv: KvLayout = "BSND",
                          ori_block_table: Tensor | None = None, cmp_block_table: Tensor | None = None,
                          cu_seqlens_q=None, cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None, seqused_q=None,
                          seqused_ori_kv=None, seqused_cmp_kv=None, cmp_residual_kv=None, ori_mask_mode: int = 4,
                          cmp_mask_mode: int = 3, ori_win_left: int = 127, ori_win_right: int = 0
                          ) -> SparseFlashMlaGradResult:
    """The backward of :func:`sparse_flash_mla` from its outputs: ``d_out`` (q's shape) and optionally
    ``d_softmax_lse`` are the gradients of ``attn_out`` and ``softmax_lse``; every other argument as the forward's.
    With ``P = exp(scale q.k - lse)`` over each row's visible keys, ``delta = rowsum(d_out * attn_out) -
    d_softmax_lse``: ``dS = P (d_out.k - delta)``, ``d_q = scale dS k``, ``d_kv = scale dS^T q + P^T d_out`` (summed
    over every row and branch that sees the key), ``d_sinks = -sum_rows exp(sink - lse) delta``. Bitwise repeatable.

    >>> q, swa = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 1, 16)
    >>> out, lse = sparse_flash_mla(q, swa, ori_win_left=3)
    >>> sparse_flash_mla_grad(q, swa, torch.ones_like(out), out, lse, ori_win_left=3).d_q.shape
    torch.Size([1, 8, 2, 16])
    """
    args = _arguments(q, ori_kv, cmp_kv, cmp_sparse_indices, ori_block_table, cmp_block_table, cu_seqlens_q,
                      cu_seqlens_ori_kv, cu_seqlens_cmp_kv, seqused_q, seqused_ori_kv, seqused_cmp_kv,
                      cmp_residual_kv, sinks, scale, cmp_ratio, ori_mask_mode, cmp_mask_mode, ori_win_left,
                      ori_win_right, layout_q, layout_kv)
    with caller_names(GRAD_OP_NAMES):
        dq, d_ori, d_cmp, d_sinks, _, l1 = call(op.dsv4_sparse_flash_mla_grad, d_out, d_softmax_lse, attn_out,
                                                softmax_lse, *args)
    return SparseFlashMlaGradResult(dq, d_ori, None if cmp_kv is None else d_cmp, None if sinks is None else d_sinks,
                                    None, None if cmp_sparse_indices is None else l1)
