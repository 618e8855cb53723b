"""Benchmark functions for msprobe's accuracy checker (``msprobe acc_check``): attnops' float64 results of the
fused-attention ops, with msprobe's bench-function signature (the NPU op's own arguments, CPU tensors out).

msprobe ships a benchmark for ``npu_fusion_attention`` only (fp64, no TND, no dropout, sparse modes 0-4); these
cover FlashAttention in every layout and sparse mode and FusedInferAttention, PFA and IFA (docs/compare.md shows
how to register them). Dropout cannot be reproduced off the NPU: a call with ``keep_prob < 1`` raises
:class:`NotImplementedError`, as do sink and MLA rope.

Each function returns what the torch_npu op returns, in float64 on the CPU: ``npu_fusion_attention`` ->
``(attention_out, softmax_max, softmax_sum)``; ``npu_fusion_attention_grad`` -> ``(dq, dk, dv, dpse)``, the exact
gradients of the float64 forward (the given ``softmax_max``/``softmax_sum``/``attention_in`` are not used);
``npu_fused_infer_attention_score`` -> ``(attention_out, softmax_lse)`` (an empty lse without
``softmax_lse_flag``); ``npu_prompt_flash_attention``/``npu_incre_flash_attention`` -> the output.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .rebuild import Call, Unsupported, bind_arguments
from .references import golden_values

__all__ = ["npu_fusion_attention", "npu_fusion_attention_grad", "npu_fused_infer_attention_score",
           "npu_prompt_flash_attention", "npu_incre_flash_attention"]

# npu_fusion_attention_grad's arguments that its forward takes under another name, or not at all
_GRAD_ONLY = {"dy", "softmax_max", "softmax_sum", "softmax_in", "attention_in", "seed", "offset", "numels"}


def _run(api: str, direction: str, arguments: dict, grads=()) -> list[Tensor | None]:
    try:
        return golden_values(Call(api, api, direction, arguments, [], list(grads)))
    except Unsupported as exc:
        raise NotImplementedError(f"attnops.msprobe.bench_functions.{api}: {exc}") from None


def npu_fusion_attention(*args, **kwargs) -> tuple[Tensor, Tensor, Tensor]:
    """``torch_npu.npu_fusion_attention``'s arguments -> float64 ``(attention_out, softmax_max, softmax_sum)``."""
    return tuple(_run("npu_fusion_attention", "forward", bind_arguments("npu_fusion_attention", list(args), kwargs)))


def npu_fusion_attention_grad(*args, **kwargs) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``torch_npu.npu_fusion_attention_grad``'s arguments -> float64 ``(dq, dk, dv, dpse)``."""
    grad_args = bind_arguments("npu_fusion_attention_grad", list(args), kwargs)
    forward = {k: v for k, v in grad_args.items() if k not in _GRAD_ONLY and k != "scale_value"}
    forward["scale"] = grad_args["scale_value"]
    return tuple(_run("npu_fusion_attention", "backward", bind_arguments("npu_fusion_attention", [], forward),
                      [grad_args["dy"]]))


def npu_fused_infer_attention_score(*args, **kwargs) -> tuple[Tensor, Tensor]:
    """``torch_npu.npu_fused_infer_attention_score``'s arguments -> float64 ``(attention_out, softmax_lse)``."""
    arguments = bind_arguments("npu_fused_infer_attention_score", list(args), kwargs)
    out, *lse = _run("npu_fused_infer_attention_score", "forward", arguments)
    return out, (lse[0] if lse else torch.empty(0, dtype=torch.float64))


def npu_prompt_flash_attention(*args, **kwargs) -> Tensor:
    """``torch_npu.npu_prompt_flash_attention``'s arguments -> the float64 output."""
    return _run("npu_prompt_flash_attention", "forward",
                bind_arguments("npu_prompt_flash_attention", list(args), kwargs))[0]


def npu_incre_flash_attention(*args, **kwargs) -> Tensor:
    """``torch_npu.npu_incre_flash_attention``'s arguments -> the float64 output."""
    return _run("npu_incre_flash_attention", "forward",
                bind_arguments("npu_incre_flash_attention", list(args), kwargs))[0]
