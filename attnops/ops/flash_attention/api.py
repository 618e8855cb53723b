"""Pythonic FlashAttention API: defaults, validation, dispatch. No math here."""
from __future__ import annotations

import contextlib
from typing import NamedTuple

from torch import Tensor

from ..._core.autocast import autocast_dtype, autocast_off, cast_inputs
from ..._core.checks import caller_names, check_same_device, require
from ..common.problem import INT_MAX
from .options import Backend, Options, Precision


class FlashAttentionResult(NamedTuple):
    """Forward results when ``return_stats=True``: pass them to :func:`flash_attention_backward`."""

    out: Tensor
    softmax_max: Tensor
    softmax_sum: Tensor
    seed: int
    offset: int


def _op():
    from . import op  # registers the custom ops on first use

    return op


def flash_attention(query: Tensor, key: Tensor, value: Tensor, *, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), layout: str = "BNSD", head_num: int | None = None,
                    scale: float | None = None, pse: Tensor | None = None, pse_type: int = 1,
                    atten_mask: Tensor | None = None, sparse_mode: int = 0, pre_tokens: int = INT_MAX,
                    next_tokens: int = INT_MAX, prefix=None, cu_seqlens_q=None, cu_seqlens_k=None,
                    max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                    actual_seq_qlen=None, actual_seq_kvlen=None, keep_prob: float = 1.0,
                    drop_mask: Tensor | None = None, seed: int | None = None, offset: int = 0,
                    q_start_idx: int = 0, kv_start_idx: int = 0, softmax_layout: str = "", softcap: float = 0.0,
                    pse_bottom_right: bool = False, return_stats: bool = False, backend: Backend = "auto",
                    precision: Precision = "exact"):
    """CANN FlashAttention (FlashAttentionScore / VarLenScore V1-V2), differentiable.

    Shapes: ``layout`` "BNSD" ``[B, N, S, D]`` (default), "BSND", "BSH"/"SBH" (``head_num`` required), or "TND"
    ``[T, N, D]`` with ``cu_seqlens_q/k`` (ints, leading 0) or ``actual_seq_qlen/kvlen`` (CANN cumulative lists).
    ``cu_seqlens`` as int32/int64 tensors on a GPU stay there (flash-attn style: never read on the host, their
    values not validated), with optional ``max_seqlen_q/k`` bounding the lengths (default: T; longer sequences are
    cut there); host lists and CPU tensors are validated.
    Key/value may have fewer heads (GQA) and value a smaller head dim Dv; the output has Dv.
    ``scale`` (a finite float) defaults to ``1/sqrt(D)``.
    Masking, flash-attn style: ``causal=True`` (bottom-right aligned when Sq != Skv, = sparse_mode 3) and
    ``window_size=(left, right)`` (keep ``i + Skv - Sq - left <= j <= i + Skv - Sq + right``, -1 = unbounded,
    = sparse_mode 4 with ``pre_tokens=left, next_tokens=right``); no mask tensor needed. Or CANN style:
    ``atten_mask`` (True/1 = masked) with ``sparse_mode`` 0-8, ``pre_tokens``, ``next_tokens`` and ``prefix``;
    sparse modes 2-8 require ``atten_mask`` (raise without one). The two styles cannot be mixed. ``pse`` with ``pse_type`` 0-3
    (types 2/3: fp32 ALiBi slopes ``[B, N]`` or ``[N]`` with ``q_start_idx``/``kv_start_idx``; CANN requires
    Sq == Skv for them; ``pse_bottom_right=True`` takes any lengths with flash-attn's ``-slope * |i + Skv - Sq - j|``).
    ``softcap`` > 0: scores ``softcap * tanh(scale*QK^T / softcap)`` before the pse and the mask (as flash-attn).
    Dropout: ``keep_prob`` < 1 with a packed ``drop_mask`` or the Philox ``seed``/``offset`` (drawn when omitted).
    Fully-masked rows return 0. Returns the output, or a :class:`FlashAttentionResult` (output, fp32 softmax
    statistics ``[B, N, Sq, 8]`` / ``[T, N, 8]``, seed, offset) when ``return_stats`` is true.
    ``precision``: "exact" (default: fp32 compute, one cast of the result) or "npu", the Ascend kernel's rounding
    for fp16/bf16 inputs (P rounded to the input dtype per 512-key block before P V, ties away from zero; see
    docs/precision.md; fp32/fp64 inputs: same as "exact"). "npu" always runs the reference, never the Triton
    kernels (``backend="triton"`` raises), and the backward of such a forward rounds as the NPU's does.

    Example::

        >>> q = k = v = torch.randn(1, 2, 16, 8)
        >>> out = attnops.flash_attention(q, k, v, causal=True)
        >>> out.shape
        torch.Size([1, 2, 16, 8])
    """
    check_same_device("query", query, key=key, value=value)
    dtype = autocast_dtype(query.device)
    if dtype is not None:
        query, key, value = cast_inputs(dtype, query, key, value)
        if pse_type in (0, 1):  # a bias tensor follows the inputs' dtype; ALiBi slopes (types 2/3) stay fp32
            (pse,) = cast_inputs(dtype, pse)
    options = Options(causal=causal, window_size=window_size, layout=layout, head_num=head_num, scale=scale, pse=pse,
                      pse_type=pse_type, atten_mask=atten_mask, sparse_mode=sparse_mode, pre_tokens=pre_tokens,
                      next_tokens=next_tokens, prefix=prefix, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, actual_seq_qlen=actual_seq_qlen,
                      actual_seq_kvlen=actual_seq_kvlen, keep_prob=keep_prob, drop_mask=drop_mask, seed=seed,
                      offset=offset, q_start_idx=q_start_idx, kv_start_idx=kv_start_idx, softmax_layout=softmax_layout,
                      softcap=softcap, pse_bottom_right=pse_bottom_right, backend=backend, precision=precision)
    args = options.op_args(query, key)
    with autocast_off(query.device) if dtype is not None else contextlib.nullcontext():
        out, smax, ssum = _op().flash_attention(query, key, value, *args.values())
    if return_stats:
        return FlashAttentionResult(out, smax, ssum, args["seed"], args["offset"])
    return out


def flash_attention_backward(dy: Tensor, query: Tensor, key: Tensor, value: Tensor, attention_out: Tensor,
                             softmax_max: Tensor, softmax_sum: Tensor, *, causal: bool = False,
                             window_size: tuple[int, int] = (-1, -1), layout: str = "BNSD",
                             head_num: int | None = None, scale: float | None = None, pse: Tensor | None = None,
                             pse_type: int = 1, atten_mask: Tensor | None = None, sparse_mode: int = 0,
                             pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX, prefix=None, cu_seqlens_q=None,
                             cu_seqlens_k=None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                             actual_seq_qlen=None, actual_seq_kvlen=None,
                             keep_prob: float = 1.0, drop_mask: Tensor | None = None, seed: int | None = None,
                             offset: int = 0, q_start_idx: int = 0, kv_start_idx: int = 0,
                             softmax_layout: str = "", softcap: float = 0.0, pse_bottom_right: bool = False,
                             backend: Backend = "auto", precision: Precision = "exact"):
    """Gradients ``(dq, dk, dv, dpse)`` of :func:`flash_attention` from the given forward results.

    Uses ``attention_out`` and the softmax statistics exactly as given (context-parallel callers pass merged
    statistics); they are never recomputed. The dropout mask is regenerated from ``drop_mask`` or from
    ``seed``/``offset`` (required when ``keep_prob`` < 1). ``dpse`` is None unless a pse tensor of type 0/1 is given.
    Every option (``causal``, ``window_size``, ``cu_seqlens_q/k`` and ``max_seqlen_q/k`` included) must match the
    forward call. ``precision="npu"``: the Ascend kernel's rounding (P and dS rounded to the input dtype before
    their products, outputs cast ties away from zero; docs/precision.md), on the reference.
    """
    require(keep_prob == 1.0 or drop_mask is not None or seed is not None, "seed",
            "the forward's seed (or a drop_mask) when keep_prob < 1", None)
    check_same_device("query", query, dy=dy, key=key, value=value, attention_out=attention_out,
                      softmax_max=softmax_max, softmax_sum=softmax_sum)
    dy, query, key, value, attention_out = cast_inputs(autocast_dtype(query.device), dy, query, key, value,
                                                       attention_out)
    if pse_type in (0, 1):
        (pse,) = cast_inputs(autocast_dtype(query.device), pse)
    options = Options(causal=causal, window_size=window_size, layout=layout, head_num=head_num, scale=scale, pse=pse,
                      pse_type=pse_type, atten_mask=atten_mask, sparse_mode=sparse_mode, pre_tokens=pre_tokens,
                      next_tokens=next_tokens, prefix=prefix, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, actual_seq_qlen=actual_seq_qlen,
                      actual_seq_kvlen=actual_seq_kvlen, keep_prob=keep_prob, drop_mask=drop_mask, seed=seed,
                      offset=offset, q_start_idx=q_start_idx, kv_start_idx=kv_start_idx, softmax_layout=softmax_layout,
                      softcap=softcap, pse_bottom_right=pse_bottom_right, backend=backend, precision=precision)
    args = options.op_args(query, key)
    with autocast_off(query.device), caller_names(attention_in="attention_out"):
        dq, dk, dv, dpse = _op().flash_attention_bwd(dy, query, key, value, attention_out, softmax_max, softmax_sum,
                                                     *args.values())
    return dq, dk, dv, _op().pse_grad(dpse, pse, pse_type)
