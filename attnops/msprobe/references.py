"""The two references a dumped call is judged with, from the same rebuilt arguments:

- :func:`golden` G: float64, computed exactly: FlashAttention and the NSA operators by attnops' operators on
  float64 inputs; FusedInferAttention/PFA/IFA, whose operator takes no float64, by the dense fp64 golden
  :func:`attnops.testing.golden_fia.fia_forward`; the DeepSeek-V4 ops by their dialect function on float64 inputs.
- :func:`emulate` E: attnops' operator with ``precision="npu"`` on the dumped inputs as they are: what a correct
  Ascend A2/A3 kernel computes, rounding included. Where the NPU's rounding is not emulated (``npu_nsa_compress``,
  FIA decode with int4 or per-token antiquant KV, the DeepSeek-V4 ops) E is attnops' exact result in the dumped
  dtypes (fp32, one cast) and :func:`emulate` says so in its note.

Both return the compared results by label (``output.<i>`` of the dumped ``output`` list) with a readable name.
Calls using features neither reference re-runs raise :class:`~.rebuild.Unsupported` (dropout, whose NPU random
mask cannot be regenerated; sink; MLA rope; torch_npu-only layouts).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._core.errors import PrecisionNotEmulatedError
from ..ops.fused_infer_attention.inputs import LAYOUTS as FIA_LAYOUTS
from ..testing.golden_fia import fia_forward
from . import dsv4_references as dsv4
from . import nsa_references as nsa
from ._reference import EMULATION, GOLDEN, Reference, unsupported_if
from .dump import MissingTensor
from .rebuild import FA_APIS, FA_GRAD_APIS, FIA_APIS, Call, Unsupported

__all__ = ["golden", "golden_values", "emulate", "npu_results", "not_dumped", "result_names", "INDEX_RESULTS"]

# results compared as sets of selected blocks / keys (verdict.judge_indices)
INDEX_RESULTS = ("topk_indices", "sparse_indices")
_FA_NAMES = {"forward": ("attention_out", "softmax_max", "softmax_sum"), "backward": ("dq", "dk", "dv", "dpse")}
_PFA_HIGH_PRECISION = range(10, 15)  # PFA sparse_mode 10-14: modes 0-4 with inner_precise 0
# FIA v2's argument names as v1's (aclnn's) names
_FIA_V2_NAMES = {"actual_seq_qlen": "actual_seq_lengths", "actual_seq_kvlen": "actual_seq_lengths_kv",
                 "num_query_heads": "num_heads", "softmax_scale": "scale", "return_softmax_lse": "softmax_lse_flag",
                 "quant_scale_out": "quant_scale2", "quant_offset_out": "quant_offset2"}
_FIA_V2_UNSUPPORTED = ("learnable_sink", "dequant_scale_query", "dequant_scale_key", "dequant_offset_key",
                       "dequant_scale_value", "dequant_offset_value", "dequant_scale_key_rope", "quant_scale_p",
                       "query_dtype", "key_dtype", "value_dtype", "query_rope_dtype", "key_rope_dtype",
                       "key_shared_prefix_dtype", "value_shared_prefix_dtype", "dequant_scale_query_dtype",
                       "dequant_scale_key_dtype", "dequant_scale_value_dtype", "dequant_scale_key_rope_dtype",
                       "out_dtype")


# ------------------------------------------------------------------------------------------- FlashAttention
def _fa_options(call: Call) -> dict[str, Any]:
    """torch_npu's FA arguments (forward or grad op) as :func:`attnops.flash_attention` options (the same for G
    and E)."""
    a = call.arguments
    unsupported_if(padding_mask=a["padding_mask"], sink=a["sink"], query_rope=a.get("query_rope"))
    if float(a["keep_prob"]) < 1.0:
        raise Unsupported(f"keep_prob={a['keep_prob']}: the NPU's dropout mask cannot be regenerated off the NPU")
    tnd = str(a["input_layout"]).upper() == "TND"
    return dict(layout=a["input_layout"], head_num=a["head_num"], scale=a["scale"] if "scale" in a else
                a["scale_value"], pse=a["pse"], pse_type=a.get("pse_type", 1), atten_mask=a["atten_mask"],
                sparse_mode=a["sparse_mode"], pre_tokens=a.get("pre_tokens", a.get("pre_tockens")),
                next_tokens=a.get("next_tokens", a.get("next_tockens")), prefix=a["prefix"],
                actual_seq_qlen=a["actual_seq_qlen"] if tnd else None,
                actual_seq_kvlen=a["actual_seq_kvlen"] if tnd else None,
                q_start_idx=a.get("q_start_idx") or 0, kv_start_idx=a.get("kv_start_idx") or 0,
                softmax_layout=a["softmax_layout"])


def _fa_prepared(call: Call, ref: Reference, *names: str) -> tuple[dict[str, Any], list[Tensor]]:
    opts = _fa_options(call)
    if opts["pse_type"] in (0, 1):
        opts["pse"] = ref.cast(opts["pse"])
    return dict(opts, precision=ref.precision), [ref.cast(call.arguments[n]) for n in names]


def _fa(call: Call, ref: Reference) -> list[Tensor | None]:
    """``npu_fusion_attention(_v2/_v3)``: the forward, or the backward from the dumped ``dy`` (after the
    reference's own forward, run once for both directions of a call number: ``call.forwards`` keeps it, with the
    golden's float64 inputs, until the backward, their last user, takes them)."""
    import attnops

    opts, inputs, fwd = call.forwards.get(ref.name, (None, None, None))  # the other direction's, same arguments
    if inputs is None:
        opts, inputs = _fa_prepared(call, ref, "query", "key", "value")
    if fwd is None:
        fwd = attnops.flash_attention(*inputs, return_stats=True, **opts)
        # the golden's float64 copies are kept (casting costs time), not the emulation's inputs (the dumped tensors)
        call.forwards[ref.name] = opts, inputs if ref is GOLDEN else None, fwd
    q, k, v = inputs
    if call.direction == "forward":
        return [fwd.out, fwd.softmax_max, fwd.softmax_sum]
    del call.forwards[ref.name]  # the backward is their last user (a forward entry after it would re-run them)
    dy = call.grads[0]
    if not isinstance(dy, Tensor):
        raise Unsupported("the backward's input.0 (the gradient of attention_out) is not a tensor")
    return list(attnops.flash_attention_backward(ref.cast(dy), q, k, v, fwd.out, fwd.softmax_max, fwd.softmax_sum,
                                                 **opts))


def _fa_grad(call: Call, ref: Reference) -> list[Tensor | None]:
    """``npu_fusion_attention_grad(_v2/_v3)`` called directly: from the given ``softmax_max``/``softmax_sum``/
    ``attention_in`` (context-parallel callers pass merged ones), as the NPU does."""
    import attnops

    opts, tensors = _fa_prepared(call, ref, "dy", "query", "key", "value", "attention_in", "softmax_max",
                                 "softmax_sum")
    dy, q, k, v, out, smax, ssum = tensors
    return list(attnops.flash_attention_backward(dy, q, k, v, out, smax, ssum, **opts))


# ------------------------------------------------------------------------------------ FusedInferAttention
def _fia_arguments(call: Call) -> dict[str, Any]:
    """PFA/IFA/FIA (v1, v2) arguments under FIA's aclnn names (as attnops.torch_npu translates them)."""
    a = dict(call.arguments)
    unsupported_if(padding_mask=a.pop("padding_mask", None), query_rope=a.pop("query_rope", None),
                   key_rope=a.pop("key_rope", None), key_rope_antiquant_scale=a.pop("key_rope_antiquant_scale", None))
    if call.api == "npu_prompt_flash_attention":
        high = a["sparse_mode"] in _PFA_HIGH_PRECISION
        a.update(sparse_mode=a["sparse_mode"] - 10 if high else a["sparse_mode"], inner_precise=0 if high else 1,
                 scale=a.pop("scale_value"))
    elif call.api == "npu_incre_flash_attention":
        a.update(actual_seq_lengths_kv=a.pop("actual_seq_lengths"), scale=a.pop("scale_value"),
                 deq_scale1=a.pop("dequant_scale1"), deq_scale2=a.pop("dequant_scale2"))
    elif call.api == "npu_fused_infer_attention_score_v2":
        unsupported_if(**{n: a.pop(n) for n in _FIA_V2_UNSUPPORTED})
        for mode in ("query_quant_mode", "key_quant_mode", "value_quant_mode"):
            if a.pop(mode):
                raise Unsupported(f"{mode}={call.arguments[mode]}: quantized v2 inputs are not re-run")
        a = {_FIA_V2_NAMES.get(n, n): v for n, v in a.items()}
    else:
        a.update(deq_scale1=a.pop("dequant_scale1"), deq_scale2=a.pop("dequant_scale2"))
    if str(a["input_layout"]).upper() not in FIA_LAYOUTS:
        raise Unsupported(f"input_layout {a['input_layout']!r}: attnops compare re-runs {', '.join(FIA_LAYOUTS)}")
    a["softmax_lse_flag"] = bool(a.get("softmax_lse_flag", False))
    return a


def _fia(call: Call, ref: Reference) -> list[Tensor]:
    """G by the dense fp64 golden; E by :func:`attnops.fused_infer_attention` with ``ref.precision``."""
    import attnops

    a = _fia_arguments(call)
    lse_flag = a["softmax_lse_flag"]
    if ref is GOLDEN:
        out, lse = fia_forward(a.pop("query"), a.pop("key"), a.pop("value"), scale_value=a.pop("scale"),
                               dtype=torch.float64, **a)
        return [out, lse] if lse_flag else [out]
    del a["softmax_lse_flag"]
    result = attnops.fused_infer_attention(a.pop("query"), a.pop("key"), a.pop("value"),
                                           layout=a.pop("input_layout"), return_lse=lse_flag,
                                           precision=ref.precision, **a)
    return list(result) if lse_flag else [result]


# -------------------------------------------------------------------------------------------------- registry
_FAMILIES = {
    **{api: (_fa, _FA_NAMES) for api in FA_APIS},
    **{api: (_fa_grad, {"forward": ("dq", "dk", "dv", "dpse")}) for api in FA_GRAD_APIS},
    **{api: (_fia, {"forward": ("attention_out", "softmax_lse")}) for api in FIA_APIS},
    **nsa.FAMILIES,
    **dsv4.FAMILIES,
}


def result_names(call: Call) -> tuple[str, ...]:
    """The names of the call's compared results, in the dumped ``output`` order."""
    names = _FAMILIES[call.api][1][call.direction]
    return names(call) if callable(names) else names


def _labelled(call: Call, values: list[Tensor | None]) -> dict[str, tuple[str, Tensor]]:
    names = result_names(call)
    return {f"output.{i}": (names[i], v) for i, v in enumerate(values[:len(names)])
            if isinstance(v, Tensor) and v.numel()}


def golden_values(call: Call) -> list[Tensor | None]:
    """G as a list in the order of the dumped ``output`` (e.g. FA forward ``[out, softmax_max, softmax_sum]``,
    backward ``[dq, dk, dv, dpse]``, FIA ``[out]`` or ``[out, softmax_lse]`` with ``softmax_lse_flag``)."""
    return _FAMILIES[call.api][0](call, GOLDEN)


def golden(call: Call) -> dict[str, tuple[str, Tensor]]:
    """G: the call's results computed exactly in float64."""
    return _labelled(call, golden_values(call))


def emulate(call: Call) -> tuple[dict[str, tuple[str, Tensor]], str]:
    """``(E, note)``: the call's results with attnops' NPU-precision mode (``precision="npu"``) on the dumped
    inputs; where that mode does not cover the call, attnops' exact result in the dumped dtypes and a note that
    says so (empty otherwise)."""
    run = _FAMILIES[call.api][0]
    note = nsa.NOT_EMULATED.get(call.api) or dsv4.NOT_EMULATED.get(call.api, "")
    try:
        return _labelled(call, run(call, EMULATION)), note
    except PrecisionNotEmulatedError as exc:
        exact = Reference("exact", EMULATION.cast, "exact")
        return _labelled(call, run(call, exact)), (f"E is attnops' exact result (fp32, one cast): the NPU "
                                                   f"rounding of this route is not emulated ({exc})")


def not_dumped(call: Call) -> dict[str, tuple[str, MissingTensor]]:
    """The results the dump holds statistics of but no tensor data, under the labels of :func:`npu_results`."""
    names = result_names(call)
    return {f"output.{i}": (names[i], v) for i, v in enumerate(call.outputs[:len(names)])
            if isinstance(v, MissingTensor)}


def npu_results(call: Call) -> dict[str, tuple[str, Tensor]]:
    """N: the dumped results under the same labels (the other outputs, e.g. seed and offset, are not compared)."""
    return _labelled(call, call.outputs)
