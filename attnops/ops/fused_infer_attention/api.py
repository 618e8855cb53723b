"""Pythonic FusedInferAttentionScore: defaults, validation, dispatch. No math here."""
from __future__ import annotations

from functools import partial
from typing import Literal, NamedTuple, Sequence

from torch import Tensor

from ..._core.checks import check_int, check_tensor, fail
from ..._core.devices import origin_device, to_cpu, to_device
from ..._core.dispatch import choose_backend
from ..._core.inference_only import run_inference_only
from ..._core.layouts import io_layouts
from . import reference
from .op import INFERENCE_ONLY
from .problem import INT_MAX, LAYOUTS, OPTION_NAMES, build_problem

Backend = Literal["auto", "reference", "triton"]


class FusedInferAttentionResult(NamedTuple):
    """``return_lse=True`` results: the output and the fp32 ``softmax_lse`` ``[B, N, Q_S, 1]`` / ``[T, N, 1]``."""

    out: Tensor
    softmax_lse: Tensor


def _num_heads(query: Tensor, in_layout: str, num_heads: int | None) -> int:
    if num_heads is not None:
        return num_heads
    if in_layout == "BSH":
        fail("num_heads", "the number of query heads (required for layout BSH)", None)
    return query.shape[2] if in_layout == "BSND" else query.shape[1]


def fused_infer_attention(query: Tensor, key: Tensor | Sequence[Tensor], value: Tensor | Sequence[Tensor], *,
                          layout: str = "BNSD", num_heads: int | None = None, num_key_value_heads: int = 0,
                          scale: float | None = None, pse_shift: Tensor | None = None,
                          atten_mask: Tensor | None = None, sparse_mode: int = 0, pre_tokens: int = INT_MAX,
                          next_tokens: int = INT_MAX, actual_seq_lengths=None, actual_seq_lengths_kv=None,
                          block_table: Tensor | None = None, block_size: int | None = None,
                          deq_scale1: Tensor | None = None, quant_scale1: Tensor | None = None,
                          deq_scale2: Tensor | None = None, quant_scale2: Tensor | None = None,
                          quant_offset2: Tensor | None = None, antiquant_scale: Tensor | None = None,
                          antiquant_offset: Tensor | None = None, antiquant_mode: int = 0,
                          key_antiquant_scale: Tensor | None = None, key_antiquant_offset: Tensor | None = None,
                          value_antiquant_scale: Tensor | None = None, value_antiquant_offset: Tensor | None = None,
                          key_antiquant_mode: int = 0, value_antiquant_mode: int = 0, query_padding_size=None,
                          kv_padding_size=None, key_shared_prefix: Tensor | None = None,
                          value_shared_prefix: Tensor | None = None, actual_shared_prefix_len=None,
                          inner_precise: int = 0, return_lse: bool = False, backend: Backend = "auto"):
    """CANN FusedInferAttentionScore (prefill and decode inference attention), with CANN's semantics.

    Shapes: ``layout`` "BNSD" ``[B, N, S, D]`` (default), "BSND", "BSH" (``num_heads`` required), "BNSD_BSND"
    (BNSD in, ``[B, S, N, D]`` out, Q_S > 1) or "TND" ``[T, N, D]`` with cumulative ``actual_seq_lengths``/``_kv``.
    ``key``/``value``: a tensor with ``num_key_value_heads`` heads (0 = ``num_heads``; GQA ratio <= 64), a list of
    per-batch tensors of different lengths, or with ``block_table`` ``[B, maxBlocks]`` a paged cache
    ``[blocknum, blocksize, N2*D]`` / ``[blocknum, N2, blocksize, D]`` / NZ ``[blocknum, N2, D/x, blocksize, x]``
    (see :class:`PagedKVCache`). ``value`` may have its own head dim Dv (e.g. K 192 / V 128): the output takes it.
    ``scale`` defaults to ``1/sqrt(D)``. Q_S = 1 (decode) uses a ``(B, KV_S)`` ``atten_mask`` and ignores
    ``sparse_mode``/``pre_tokens``/``next_tokens``; Q_S > 1 takes sparse modes 0-4 as CANN (2-4 with the 2048x2048
    mask). ``actual_seq_lengths(_kv)``: per-batch lengths (one value is shared; the first B of a longer list).
    Quantization, antiquant, left padding and the shared prefix use the aclnn parameter names and rules
    (``docs/decisions.md``). Rows that attend to nothing, and rows outside the actual lengths, are 0 (lse +inf).
    Returns the output (fp16 for an int8 query, int8 with ``quant_scale2``, else the query dtype), or
    ``(out, softmax_lse)`` when ``return_lse`` is true. Inference only: with inputs that require grad the results
    carry a grad_fn, and a backward through them raises :class:`attnops.InferenceOnlyError`.

    Example::

        >>> q, k, v = torch.randn(2, 8, 1, 64), torch.randn(2, 2, 100, 64), torch.randn(2, 2, 100, 64)
        >>> out = attnops.fused_infer_attention(q, k, v, num_key_value_heads=2, actual_seq_lengths_kv=[100, 37])
        >>> out.shape  # GQA decode, the second batch attends to its first 37 keys
        torch.Size([2, 8, 1, 64])
    """
    options = {name: value_ for name, value_ in locals().items() if name in OPTION_NAMES}
    check_tensor("query", query)
    choose_backend(backend, query.device)  # validates the choice; every device runs the reference (CPU copies)
    in_layout, _ = io_layouts("layout", layout, LAYOUTS)
    num_heads = check_int("num_heads", _num_heads(query, in_layout, num_heads), lo=1)
    if scale is None:
        d = query.shape[-1] // num_heads if in_layout == "BSH" else query.shape[-1]
        scale = d ** -0.5
    if isinstance(actual_shared_prefix_len, int):
        actual_shared_prefix_len = [actual_shared_prefix_len]
    options.update(num_heads=num_heads, scale=scale, input_layout=layout,
                   actual_shared_prefix_len=actual_shared_prefix_len)
    device = origin_device(query, key, value, options)
    out, lse = run_inference_only(INFERENCE_ONLY, partial(_forward, query, key, value, options, device), query, key,
                                  value, options)
    return FusedInferAttentionResult(out, lse) if return_lse else out


def _forward(query, key, value, options: dict, device) -> tuple[Tensor, Tensor]:
    """The reference on CPU copies; results on ``device`` (None: the CPU)."""
    return to_device(reference.forward(build_problem(*to_cpu((query, key, value)), **to_cpu(options))), device)
