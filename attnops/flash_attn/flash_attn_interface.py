"""flash-attn 2's attention functions (``flash_attn.flash_attn_interface``) on :func:`attnops.flash_attention`:
the same names, arguments, defaults, shapes and return values; CPU reference or Triton kernels by device.

Dense tensors are ``[B, S, H, D]`` (attnops layout "BSND"), varlen ones ``[T, H, D]`` with int32 ``cu_seqlens``
(layout "TND"). ``causal`` and ``window_size`` are bottom-right aligned; ``alibi_slopes`` adds
``-slope * |i + Sk - Sq - j|``; ``softcap`` > 0 caps the scaled scores at ``softcap * tanh(S / softcap)``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.checks import caller_names, check_scale, check_tensor, require
from ..ops.flash_attention import attention_probabilities, flash_attention
from .errors import flash_attn_errors
from .kvcache import flash_attn_with_kvcache
from .outputs import block_size_n, s_dmask, softmax_lse
from .paged import packed_from_pages
from .window import as_pair

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

USE_TRITON_ROCM = False  # flash-attn's flag for its AMD Triton backend: attnops is never that backend


# the core's names of the arguments this module passes on unchanged -> flash-attn's
_CALLER_NAMES = {"query": "q", "key": "k", "value": "v"}


def _check_options(dropout_p, softmax_scale, window_size, alibi_slopes, deterministic, batch: int,
                   heads: int) -> tuple[int, int]:
    """Validate, under flash-attn's names, the options the core sees under other names or values; returns
    ``window_size`` as a tuple."""
    ok = isinstance(dropout_p, (int, float)) and not isinstance(dropout_p, bool) and 0.0 <= dropout_p < 1.0
    require(ok, "dropout_p", "a float in [0, 1) (0.0 in evaluation)", dropout_p)
    if softmax_scale is not None:
        check_scale("softmax_scale", softmax_scale)
    require(isinstance(deterministic, bool), "deterministic", "a bool", deterministic)
    window_size = as_pair(window_size)
    require(isinstance(window_size, (tuple, list)) and len(window_size) == 2, "window_size",
            "a pair (left, right) of ints (or a 2-element integer tensor), -1 for an unbounded side", window_size)
    if alibi_slopes is not None:
        check_tensor("alibi_slopes", alibi_slopes, ndim=(1, 2), dtypes=(torch.float32,))
        require(alibi_slopes.shape in ((heads,), (batch, heads)) or (batch is None and alibi_slopes.shape[-1] == heads),
                "alibi_slopes",
                f"fp32 slopes of shape (nheads={heads},) or (batch_size={batch}, nheads={heads})", alibi_slopes)
    return tuple(window_size)


def _batch_size(q: Tensor, cu_seqlens_q) -> int | None:
    """B of a dense ``q``, or of a 1-D ``cu_seqlens_q`` (None when it is malformed: the core names it)."""
    if cu_seqlens_q is None:
        return q.shape[0]
    if isinstance(cu_seqlens_q, (list, tuple)) or (isinstance(cu_seqlens_q, Tensor) and cu_seqlens_q.dim() == 1):
        return len(cu_seqlens_q) - 1
    return None


def attention(q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float, softmax_scale: float | None, causal: bool,
              window_size, softcap: float, alibi_slopes: Tensor | None, deterministic: bool,
              return_attn_probs: bool, cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
              max_seqlen_q: int | None = None, max_seqlen_k: int | None = None):
    """The shared body of the functions below (varlen when ``cu_seqlens_q`` is given): ``out``, or
    ``(out, softmax_lse, S_dmask)`` with ``return_attn_probs`` (``S_dmask`` empty without dropout, as in
    flash-attn). ``deterministic`` is accepted: attnops' backward is always deterministic."""
    varlen = cu_seqlens_q is not None
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, ndim=3 if varlen else 4)
    batch = _batch_size(q, cu_seqlens_q)
    window = _check_options(dropout_p, softmax_scale, window_size, alibi_slopes, deterministic, batch, q.shape[-2])
    options = dict(layout="TND" if varlen else "BSND", causal=causal, window_size=window, scale=softmax_scale,
                   softcap=softcap, keep_prob=1.0 - dropout_p)
    if alibi_slopes is not None:
        options.update(pse=alibi_slopes, pse_type=2, pse_bottom_right=True)
    if varlen:
        options.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                       max_seqlen_k=max_seqlen_k, softmax_layout="TND")
    with caller_names(_CALLER_NAMES):
        result = flash_attention(q, k, v, return_stats=True, **options)
    if not return_attn_probs:
        return result.out
    if dropout_p == 0:
        return result.out, softmax_lse(result, varlen), q.new_empty((0,))
    probs = attention_probabilities(q, k, v, result, dtype=torch.float32, **options)
    return result.out, softmax_lse(result, varlen), s_dmask(probs, block_size_n(q.shape[-1], True), q.dtype)


def _get_block_size_n(device, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """flash-attn's helper for decoding ``S_dmask``: the width of the key blocks whose running maximum scales it
    (see ``docs/flash_attn.md``); ``device`` and ``is_causal`` do not change it in attnops."""
    require(isinstance(head_dim, int) and 0 < head_dim <= 256, "head_dim", "an int in [1, 256]", head_dim)
    return block_size_n(head_dim, is_dropout)


@flash_attn_errors
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Attention of ``q`` ``[B, Sq, H, D]`` over ``k``/``v`` ``[B, Sk, H_k, D]`` (``H`` a multiple of ``H_k``).

    ``dropout_p``: dropout on the probabilities (0.0 in evaluation). ``softmax_scale``: default ``D ** -0.5``.
    ``causal`` / ``window_size=(left, right)``: keep ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (-1:
    unbounded; causal sets right = 0); rows with no key give 0. ``softcap`` > 0: ``softcap * tanh(S / softcap)``.
    ``alibi_slopes`` fp32 ``(H,)`` or ``(B, H)``: bias ``-slope * |i + Sk - Sq - j|``.
    Returns ``out`` ``[B, Sq, H, D]``, or with ``return_attn_probs`` ``(out, softmax_lse [B, H, Sq] fp32,
    S_dmask)`` (see ``docs/flash_attn.md``).

    Example::

        >>> q = k = v = torch.randn(1, 16, 2, 8)
        >>> flash_attn_func(q, k, v, causal=True).shape
        torch.Size([1, 16, 2, 8])
    """
    return attention(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                     deterministic=deterministic, return_attn_probs=return_attn_probs)


def _unpack(name: str, packed: Tensor, dim: int, count: int) -> tuple[Tensor, ...]:
    """The ``count`` tensors stacked along ``dim`` of ``packed`` (views: gradients flow back into it)."""
    check_tensor(name, packed)
    require(packed.dim() > dim and packed.shape[dim] == count, name,
            f"a tensor with {count} stacked along dim {dim}", packed)
    return packed.unbind(dim)


def _packed_names(packed: str, *unpacked: str):
    """Errors about the tensors unpacked from ``packed`` name ``packed``, as the caller passed it."""
    return caller_names(dict.fromkeys(unpacked, packed))


def _require_offsets(**cu_seqlens) -> None:
    for name, offsets in cu_seqlens.items():
        require(offsets is not None, name, "int32 offsets [batch_size + 1] of the packed sequences", offsets)


@flash_attn_errors
def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` of ``qkv`` ``[B, S, 3, H, D]`` (its gradient comes back in the same packed form)."""
    q, k, v = _unpack("qkv", qkv, 2, 3)
    with _packed_names("qkv", "q", "k", "v"):
        return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, return_attn_probs)


@flash_attn_errors
def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` of ``q`` ``[B, Sq, H, D]`` and ``kv`` ``[B, Sk, 2, H_k, D]``."""
    k, v = _unpack("kv", kv, 2, 2)
    with _packed_names("kv", "k", "v"):
        return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, return_attn_probs)


@flash_attn_errors
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """:func:`flash_attn_func` over packed sequences: ``q`` ``[T_q, H, D]``, ``k``/``v`` ``[T_k, H_k, D]``, sequence
    ``b`` at ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` (int32 ``[B + 1]``, leading 0), lengths at most
    ``max_seqlen_q/k``. Masks and ALiBi are aligned per sequence. ``softmax_lse`` is ``[H, T_q]``.
    ``block_table`` (int32 ``[B, max_blocks]``): ``k``/``v`` are paged caches ``[num_blocks, page, H_k, D]``, token
    ``t`` of sequence ``b`` at row ``t % page`` of page ``block_table[b, t // page]``."""
    _require_offsets(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if block_table is not None:
        k, v = packed_from_pages(k, v, block_table, cu_seqlens_k)
    return attention(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                     deterministic=deterministic, return_attn_probs=return_attn_probs, cu_seqlens_q=cu_seqlens_q,
                     cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


@flash_attn_errors
def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """:func:`flash_attn_varlen_func` of ``qkv`` ``[T, 3, H, D]``, one ``cu_seqlens`` for queries and keys."""
    q, k, v = _unpack("qkv", qkv, 1, 3)
    with _packed_names("qkv", "q", "k", "v"), _packed_names("cu_seqlens", "cu_seqlens_q", "cu_seqlens_k"), \
            _packed_names("max_seqlen", "max_seqlen_q", "max_seqlen_k"):
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                      softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                      return_attn_probs)


@flash_attn_errors
def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_varlen_func` of ``q`` ``[T_q, H, D]`` and ``kv`` ``[T_k, 2, H_k, D]``."""
    k, v = _unpack("kv", kv, 1, 2)
    with _packed_names("kv", "k", "v"):
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                      softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                      return_attn_probs)
