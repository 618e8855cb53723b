"""Pythonic FusedInferAttentionScore: defaults, validation, dispatch. No math here."""
from __future__ import annotations

import inspect
from functools import partial
from typing import Literal, NamedTuple, Sequence

import torch
from torch import Tensor

from ..._core.autocast import autocast_dtype, autocast_off, cast_inputs
from ..._core.checks import check_choice, check_int, check_same_device, check_tensor, fail, require, softmax_scale
from ..._core.dispatch import BACKENDS
from ..common.npu_rounding import check_precision
from ..._core.inference_only import run_inference_only
from ..._core.layouts import io_layouts
from ..._core.masks import window_sparse_args
from . import backends
from .op import INFERENCE_ONLY
from .inputs import LAYOUTS
from .problem import INT_MAX, OPTION_NAMES

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
                          layout: str = "BNSD", causal: bool = False, num_heads: int | None = None,
                          num_key_value_heads: int = 0, scale: float | None = None, pse_shift: Tensor | None = None,
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
                          inner_precise: int = 0, return_lse: bool = False, backend: Backend = "auto",
                          precision: Literal["exact", "npu"] = "exact"):
    """CANN FusedInferAttentionScore (prefill and decode inference attention), with CANN's semantics.

    Shapes: ``layout`` "BNSD" ``[B, N, S, D]`` (default), "BSND", "BSH" (``num_heads`` required), "BNSD_BSND"
    (BNSD in, ``[B, S, N, D]`` out, Q_S > 1) or "TND" ``[T, N, D]`` with cumulative ``actual_seq_lengths``/``_kv``.
    ``key``/``value``: a tensor with ``num_key_value_heads`` heads (0 = ``num_heads``; GQA ratio <= 64), a list of
    per-batch tensors of different lengths, or with ``block_table`` ``[B, maxBlocks]`` a paged cache
    ``[blocknum, blocksize, N2*D]`` / ``[blocknum, N2, blocksize, D]`` / NZ ``[blocknum, N2, D/x, blocksize, x]``
    (see :class:`PagedKVCache`) or flash-attn/vLLM's ``[blocknum, blocksize, N2, D]`` (read as its ``.flatten(2)``
    view; a shape that is both 4-D forms, blocksize = N2, with a BNSD/TND query is CANN's). ``value`` may have
    its own head dim Dv (e.g. K 192 / V 128): the output takes it.
    ``scale`` defaults to ``1/sqrt(D)``. ``causal=True`` (flash-attn style, bottom-right aligned when
    Q_S != KV_S) is sparse_mode 3 with the compressed mask at Q_S > 1 and masks nothing at Q_S = 1; it cannot be
    combined with ``atten_mask``, ``sparse_mode``, ``pre_tokens`` or ``next_tokens``.
    Q_S = 1 (decode) uses a ``(B, KV_S)`` ``atten_mask`` and ignores
    ``sparse_mode``/``pre_tokens``/``next_tokens``; Q_S > 1 takes sparse modes 0-4 as CANN (2-4 with the 2048x2048
    mask). ``actual_seq_lengths(_kv)``: per-batch lengths (one value is shared; the first B of a longer list).
    Quantization, antiquant, left padding and the shared prefix use the aclnn parameter names and rules
    (``docs/decisions.md``). Rows that attend to nothing, and rows outside the actual lengths, are 0 (lse +inf).
    Returns the output (fp16 for an int8 query, int8 with ``quant_scale2``, else the query dtype), or
    ``(out, softmax_lse)`` when ``return_lse`` is true. Inference only: with inputs that require grad the results
    carry a grad_fn, and a backward through them raises :class:`attnops.InferenceOnlyError`.
    Every tensor must be on the query's device. Under ``torch.autocast`` the floating-point query, key, value,
    shared prefix and ``pse_shift`` are cast to the autocast dtype (as SDPA); int8 inputs are left alone.
    ``precision``: "exact" (default: fp32 compute, output cast ties away from zero) or "npu", the Ascend kernels'
    rounding (P in the input dtype before P V; decode bf16 outputs ties to even; fp16 prefill with
    ``inner_precise=1`` scores and softmax in fp16; int8 query planes against int8 KV; int8 output through fp16;
    docs/precision.md). "npu" always runs the reference, never the Triton kernels.

    Example::

        >>> q, k, v = torch.randn(2, 8, 1, 64), torch.randn(2, 2, 100, 64), torch.randn(2, 2, 100, 64)
        >>> out = attnops.fused_infer_attention(q, k, v, num_key_value_heads=2, actual_seq_lengths_kv=[100, 37])
        >>> out.shape  # GQA decode, the second batch attends to its first 37 keys
        torch.Size([2, 8, 1, 64])
    """
    query, key, value, options = call_options(query, key, value, locals())
    backend = "reference" if options["precision"] == "npu" else backend
    with autocast_off(query.device):
        if torch.compiler.is_compiling() and isinstance(key, Tensor) and isinstance(value, Tensor):
            out, lse = _traced_op(query, key, value, options)  # the op, so that no length value is traced
        else:
            out, lse = run_inference_only(INFERENCE_ONLY, partial(backends.forward, query, key, value, options,
                                                                  backend), query, key, value,
                                          tensor_options(options))
    return FusedInferAttentionResult(out, lse) if return_lse else out


def _traced_op(query: Tensor, key: Tensor, value: Tensor, options: dict) -> tuple[Tensor, Tensor]:
    """The call as the ``attnops::fused_infer_attention`` custom op (under ``torch.compile``: the fake kernel needs
    only shapes, so lengths given as tensors serve every length set with one graph)."""
    from . import op

    args = dict(options, block_size=options["block_size"] or 0)
    for name in ("actual_seq_lengths", "actual_seq_lengths_kv"):
        if isinstance(args[name], Tensor):
            args[f"{name}_tensor"], args[name] = args[name], None
    return op.fused_infer_attention(query, key, value, **{name: args[name] for name in op.ARGUMENT_NAMES
                                                          if name in args})


SIGNATURE = inspect.signature(fused_infer_attention)


def call_options(query: Tensor, key, value, arguments: dict) -> tuple[Tensor, object, object, dict]:
    """The call's ``(query, key, value, options)`` from the Pythonic ``arguments`` (:func:`fused_infer_attention`'s
    parameters by name): devices checked, autocast applied, defaults resolved, options under the aclnn names."""
    check_tensor("query", query)
    check_devices(query, key, value, arguments)
    dtype = autocast_dtype(query.device)
    a = dict(arguments)
    query, a["pse_shift"], a["key_shared_prefix"], a["value_shared_prefix"] = cast_inputs(
        dtype, query, a["pse_shift"], a["key_shared_prefix"], a["value_shared_prefix"])
    key, value = _cast_kv(dtype, key), _cast_kv(dtype, value)
    check_choice("backend", a["backend"], BACKENDS)
    if check_precision(a.get("precision", "exact")) == "npu":
        require(a["backend"] in ("auto", "reference"), "backend", "'auto' or 'reference' with precision='npu' (the "
                "NPU emulation runs the reference)", a["backend"])
    in_layout, _ = io_layouts("layout", a["layout"], LAYOUTS)
    num_heads = check_int("num_heads", _num_heads(query, in_layout, a["num_heads"]), lo=1)
    scale = softmax_scale(a["scale"], query, query.shape[-1] // num_heads if in_layout == "BSH" else query.shape[-1])
    a["sparse_mode"], a["atten_mask"] = _causal_args(a["causal"], query, in_layout, sparse_mode=a["sparse_mode"],
                                                     atten_mask=a["atten_mask"], pre_tokens=a["pre_tokens"],
                                                     next_tokens=a["next_tokens"])
    options = {name: a[name] for name in OPTION_NAMES if name in a}
    prefix_len = a["actual_shared_prefix_len"]
    options.update(num_heads=num_heads, scale=scale, input_layout=a["layout"],
                   actual_shared_prefix_len=[prefix_len] if isinstance(prefix_len, int) else prefix_len)
    return query, key, value, options


def tensor_options(options: dict) -> dict:
    """The tensors among ``options`` (what an inference-only guard searches for tensors requiring grad)."""
    return {name: x for name, x in options.items() if isinstance(x, Tensor)}


_TENSOR_OPTIONS = ("pse_shift", "atten_mask", "block_table", "deq_scale1", "quant_scale1", "deq_scale2",
                   "quant_scale2", "quant_offset2", "antiquant_scale", "antiquant_offset", "key_antiquant_scale",
                   "key_antiquant_offset", "value_antiquant_scale", "value_antiquant_offset", "key_shared_prefix",
                   "value_shared_prefix")


def check_devices(query: Tensor, key, value, arguments: dict) -> None:
    """key, value (every tensor of a list) and every tensor option on the query's device: never copied silently."""
    kv = {f"{name}[{i}]" if isinstance(x, (list, tuple)) else name: t
          for name, x in (("key", key), ("value", value))
          for i, t in enumerate(x if isinstance(x, (list, tuple)) else [x])}
    check_same_device("query", query, **kv, **{name: arguments[name] for name in _TENSOR_OPTIONS})


def _cast_kv(dtype, kv):
    """A key/value tensor or list of tensors, cast as :func:`cast_inputs` does."""
    return list(cast_inputs(dtype, *kv)) if isinstance(kv, (list, tuple)) else cast_inputs(dtype, kv)[0]


def _causal_args(causal, query: Tensor, in_layout: str, **mask_args) -> tuple[int, Tensor | None]:
    """flash-attn's bottom-right ``causal=True`` as ``(sparse_mode, atten_mask)``: mode 3 with the compressed mask,
    or no mask at Q_S = 1 (the single query row sits at the bottom and sees every key)."""
    sparse = window_sparse_args(causal, (-1, -1), device=query.device, **mask_args)
    if sparse is None:
        return mask_args["sparse_mode"], mask_args["atten_mask"]
    q_s = {"BNSD": 2, "BSND": 1, "BSH": 1}.get(in_layout)
    if q_s is not None and query.dim() > q_s and query.shape[q_s] == 1:
        return 0, None
    return sparse["sparse_mode"], sparse["atten_mask"]

