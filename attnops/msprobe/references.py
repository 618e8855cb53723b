"""The two references a dumped call is judged with, from the same rebuilt arguments:

- :func:`golden` G: float64, computed exactly: FlashAttention and NSA selected attention by attnops' operator on
  float64 inputs; FusedInferAttention/PFA/IFA, whose operator takes no float64, by the dense fp64 golden
  :func:`attnops.testing.golden_fia.fia_forward`.
- :func:`emulate` E: attnops' operator with ``precision="npu"`` on the dumped inputs as they are: what a correct
  Ascend A2/A3 kernel computes, rounding included.

Both return the compared results by label (``output.<i>`` of the dumped ``output`` list) with a readable name.
Calls using features neither reference re-runs raise :class:`~.rebuild.Unsupported` (dropout, whose NPU random
mask cannot be regenerated; sink; MLA rope; torch_npu-only layouts).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..ops.fused_infer_attention.problem import LAYOUTS as FIA_LAYOUTS
from ..testing.golden_fia import fia_forward
from .rebuild import FA_APIS, FIA_APIS, NSA_APIS, Call, Unsupported

__all__ = ["golden", "golden_values", "emulate", "npu_results", "RESULT_NAMES"]

RESULT_NAMES = {
    ("fa", "forward"): ("attention_out", "softmax_max", "softmax_sum"),
    ("fa", "backward"): ("dq", "dk", "dv", "dpse"),
    ("fia", "forward"): ("attention_out", "softmax_lse"),
    ("nsa_select", "forward"): ("attention_out", "softmax_max", "softmax_sum"),
    ("nsa_select", "backward"): ("dq", "dk", "dv"),
}
_FAMILY = {**dict.fromkeys(FA_APIS, "fa"), **dict.fromkeys(FIA_APIS, "fia"), **dict.fromkeys(NSA_APIS, "nsa_select")}
_PFA_HIGH_PRECISION = range(10, 15)  # PFA sparse_mode 10-14: modes 0-4 with inner_precise 0


def _family(call: Call) -> str:
    return _FAMILY[call.api]


def _unsupported_if(call: Call, **given: Any) -> None:
    for name, value in given.items():
        if value is not None and not (isinstance(value, Tensor) and value.numel() == 0):
            raise Unsupported(f"{name} is given: not re-run by attnops compare")


# ------------------------------------------------------------------------------------------- FlashAttention
def _fa_options(call: Call) -> dict[str, Any]:
    """torch_npu's FA arguments as :func:`attnops.flash_attention` options (the same for G and E)."""
    a = call.arguments
    _unsupported_if(call, padding_mask=a["padding_mask"], sink=a["sink"], query_rope=a.get("query_rope"))
    if float(a["keep_prob"]) < 1.0:
        raise Unsupported(f"keep_prob={a['keep_prob']}: the NPU's dropout mask cannot be regenerated off the NPU")
    tnd = str(a["input_layout"]).upper() == "TND"
    return dict(layout=a["input_layout"], head_num=a["head_num"], scale=a["scale"], pse=a["pse"],
                pse_type=a.get("pse_type", 1), atten_mask=a["atten_mask"], sparse_mode=a["sparse_mode"],
                pre_tokens=a.get("pre_tokens", a.get("pre_tockens")),
                next_tokens=a.get("next_tokens", a.get("next_tockens")), prefix=a["prefix"],
                actual_seq_qlen=a["actual_seq_qlen"] if tnd else None,
                actual_seq_kvlen=a["actual_seq_kvlen"] if tnd else None,
                q_start_idx=a.get("q_start_idx") or 0, kv_start_idx=a.get("kv_start_idx") or 0,
                softmax_layout=a["softmax_layout"])


def _f64(x):
    return x.to(torch.float64) if isinstance(x, Tensor) and x.is_floating_point() else x


def _fa(call: Call, *, to_dtype, **precision) -> list[Tensor | None]:
    import attnops

    opts = _fa_options(call)
    if opts["pse_type"] in (0, 1):
        opts["pse"] = to_dtype(opts["pse"])
    q, k, v = (to_dtype(call.arguments[n]) for n in ("query", "key", "value"))
    fwd = attnops.flash_attention(q, k, v, return_stats=True, **opts, **precision)
    if call.direction == "forward":
        return [fwd.out, fwd.softmax_max, fwd.softmax_sum]
    dy = call.grads[0]
    if not isinstance(dy, Tensor):
        raise Unsupported("the backward's input.0 (the gradient of attention_out) is not a tensor")
    return list(attnops.flash_attention_backward(to_dtype(dy), q, k, v, fwd.out, fwd.softmax_max, fwd.softmax_sum,
                                                 **opts, **precision))


# ------------------------------------------------------------------------------------ FusedInferAttention
def _fia_arguments(call: Call) -> dict[str, Any]:
    """PFA/IFA/FIA arguments under FIA's aclnn names (as attnops.torch_npu translates them)."""
    a = dict(call.arguments)
    _unsupported_if(call, padding_mask=a.pop("padding_mask", None), query_rope=a.pop("query_rope", None),
                    key_rope=a.pop("key_rope", None), key_rope_antiquant_scale=a.pop("key_rope_antiquant_scale", None))
    if call.api == "npu_prompt_flash_attention":
        high = a["sparse_mode"] in _PFA_HIGH_PRECISION
        a.update(sparse_mode=a["sparse_mode"] - 10 if high else a["sparse_mode"], inner_precise=0 if high else 1,
                 scale=a.pop("scale_value"))
    elif call.api == "npu_incre_flash_attention":
        a.update(actual_seq_lengths_kv=a.pop("actual_seq_lengths"), scale=a.pop("scale_value"),
                 deq_scale1=a.pop("dequant_scale1"), deq_scale2=a.pop("dequant_scale2"))
    else:
        a.update(deq_scale1=a.pop("dequant_scale1"), deq_scale2=a.pop("dequant_scale2"))
    if str(a["input_layout"]).upper() not in FIA_LAYOUTS:
        raise Unsupported(f"input_layout {a['input_layout']!r}: attnops compare re-runs {', '.join(FIA_LAYOUTS)}")
    a["softmax_lse_flag"] = bool(a.get("softmax_lse_flag", False))
    return a


def _fia_golden(call: Call) -> list[Tensor]:
    a = _fia_arguments(call)
    out, lse = fia_forward(a.pop("query"), a.pop("key"), a.pop("value"), scale_value=a.pop("scale"),
                           dtype=torch.float64, **a)
    return [out, lse] if a["softmax_lse_flag"] else [out]


def _fia_emulation(call: Call) -> list[Tensor]:
    import attnops

    a = _fia_arguments(call)
    lse_flag = a.pop("softmax_lse_flag")
    result = attnops.fused_infer_attention(
        a.pop("query"), a.pop("key"), a.pop("value"), layout=a.pop("input_layout"), return_lse=lse_flag,
        precision="npu", **a)
    return list(result) if lse_flag else [result]


# ------------------------------------------------------------------------------------- NSA selected attention
def _nsa_select(call: Call, *, to_dtype, **precision) -> list[Tensor]:
    """``npu_nsa_select_attention`` as :func:`attnops.nsa_selected_attention` (its ``atten_mask`` is the causal
    mask of sparse mode 2: ``causal=True``); the backward by autograd from the dumped ``dy``."""
    import attnops

    a = call.arguments
    q, k, v = (to_dtype(a[n]).detach() for n in ("query", "key", "value"))
    options = dict(select_block_size=a["select_block_size"], causal=a["atten_mask"] is not None,
                   scale=a["scale_value"], actual_seq_qlen=a["actual_seq_qlen"],
                   actual_seq_kvlen=a["actual_seq_kvlen"], **precision)
    if call.direction == "forward":
        return list(attnops.nsa_selected_attention(q, k, v, a["topk_indices"], return_stats=True, **options))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out = attnops.nsa_selected_attention(*leaves, a["topk_indices"], **options)
    return list(torch.autograd.grad(out, leaves, to_dtype(call.grads[0])))


# ------------------------------------------------------------------------------------------------- public
def _labelled(call: Call, values: list[Tensor | None]) -> dict[str, tuple[str, Tensor]]:
    names = RESULT_NAMES[(_family(call), call.direction)]
    return {f"output.{i}": (names[i], v) for i, v in enumerate(values) if isinstance(v, Tensor) and v.numel()}


def golden_values(call: Call) -> list[Tensor | None]:
    """G as a list: FA forward ``[out, softmax_max, softmax_sum]``, backward ``[dq, dk, dv, dpse]``, FIA ``[out]``
    or ``[out, softmax_lse]`` with ``softmax_lse_flag``."""
    family = _family(call)
    if family == "fia":
        return _fia_golden(call)
    return (_fa if family == "fa" else _nsa_select)(call, to_dtype=_f64)


def golden(call: Call) -> dict[str, tuple[str, Tensor]]:
    """G: the call's results computed exactly in float64."""
    return _labelled(call, golden_values(call))


def emulate(call: Call) -> dict[str, tuple[str, Tensor]]:
    """E: the call's results with attnops' NPU-precision mode (``precision="npu"``) on the dumped inputs."""
    family = _family(call)
    if family == "fia":
        return _labelled(call, _fia_emulation(call))
    return _labelled(call, (_fa if family == "fa" else _nsa_select)(call, to_dtype=lambda x: x, precision="npu"))


def npu_results(call: Call) -> dict[str, tuple[str, Tensor]]:
    """N: the dumped results under the same labels."""
    names = RESULT_NAMES[(_family(call), call.direction)]
    return {f"output.{i}": (names[i] if i < len(names) else f"output.{i}", v) for i, v in enumerate(call.outputs)
            if isinstance(v, Tensor) and v.numel()}
