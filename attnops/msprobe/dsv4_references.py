"""G and E of the DeepSeek-V4 ops (registered with msprobe as custom APIs): each re-run by the dialect function the
dump names (``cann_ops_transformer.*`` or vllm-ascend's ``_C_ascend.*``), with the dumped arguments in the
reference's dtype: G on float64 inputs (attnops computes them exactly in float64), E on the dumped inputs (fp32
accumulation, one cast to the output dtype: attnops' DeepSeek-V4 operators have no NPU rounding mode, so every
call carries :data:`NOT_EMULATED`'s note)."""
from __future__ import annotations

from typing import Any

from torch import Tensor

from .. import cann_ops_transformer as cot
from ..torch_npu import dsv4 as vllm
from ._reference import Reference
from .rebuild import Call

__all__ = ["FAMILIES", "NOT_EMULATED"]

_NOTE = ("E is attnops' exact result (fp32 accumulation, one cast): the NPU rounding of DeepSeek-V4's {what} is not "
         "emulated")
_ATTENTION = _NOTE.format(what="sparse attention (P rounded to the input dtype before P.V)")


def _arguments(call: Call, ref: Reference, keep: tuple[str, ...]) -> dict[str, Any]:
    """The dumped arguments with every floating-point tensor but those named in ``keep`` in the reference's dtype (a
    copy: the references never write into the dumped tensors, e.g. the compressor's state cache)."""
    return {name: (ref.cast(v).clone() if isinstance(v, Tensor) and v.is_floating_point() and name not in keep
                   else v) for name, v in call.arguments.items()}


def _runner(fn, keep: tuple[str, ...] = ()):
    """A reference running ``fn``; ``keep``: arguments left in their dumped dtype (the quantised indexer's scales and
    weights, which it dequantises in fp32 whatever the reference)."""
    def run(call: Call, ref: Reference) -> list[Tensor | None]:
        result = fn(**_arguments(call, ref, keep))
        return list(result) if isinstance(result, tuple) else [result]
    return run


def _attention_names(call: Call) -> tuple[str, ...]:
    """``softmax_lse`` is a result only when requested (else the op returns a placeholder)."""
    return ("attn_out", "softmax_lse") if call.arguments["return_softmax_lse"] else ("attn_out",)


_GRAD_NAMES = ("d_q", "d_ori_kv", "d_cmp_kv", "d_sinks", "ori_softmax_l1_norm", "cmp_softmax_l1_norm")
_INDEXER_NAMES = ("sparse_indices",)  # sparse_values (tie-ordered, -inf padded) are not judged

FAMILIES: dict[str, tuple[Any, dict[str, Any]]] = {
    "cann_ops_transformer.sparse_flash_mla": (_runner(cot.sparse_flash_mla), {"forward": _attention_names}),
    "cann_ops_transformer.sparse_flash_mla_grad": (_runner(cot.sparse_flash_mla_grad), {"forward": _GRAD_NAMES}),
    "cann_ops_transformer.compressor": (_runner(cot.compressor), {"forward": ("cmp_kv",)}),
    "cann_ops_transformer.lightning_indexer": (_runner(cot.lightning_indexer), {"forward": _INDEXER_NAMES}),
    "_C_ascend.npu_sparse_attn_sharedkv": (_runner(vllm.npu_sparse_attn_sharedkv), {"forward": _attention_names}),
    "_C_ascend.compressor": (_runner(vllm.compressor), {"forward": ("cmp_kv",)}),
    "_C_ascend.npu_vllm_quant_lightning_indexer": (
        _runner(vllm.npu_vllm_quant_lightning_indexer, keep=("weights", "query_dequant_scale", "key_dequant_scale")),
        {"forward": _INDEXER_NAMES}),
}
NOT_EMULATED = {
    "cann_ops_transformer.sparse_flash_mla": _ATTENTION,
    "cann_ops_transformer.sparse_flash_mla_grad": _NOTE.format(what="sparse attention gradients"),
    "_C_ascend.npu_sparse_attn_sharedkv": _ATTENTION,
    **dict.fromkeys(("cann_ops_transformer.compressor", "_C_ascend.compressor"), _NOTE.format(what="compressor")),
    **dict.fromkeys(("cann_ops_transformer.lightning_indexer", "_C_ascend.npu_vllm_quant_lightning_indexer"),
                    _NOTE.format(what="lightning indexer scores")),
}
