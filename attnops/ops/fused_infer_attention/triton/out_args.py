"""Host side of ``rounding.py``: the output conversion of a problem (fp32 cast, CAST_ROUND to fp16/bf16, or int8 with
``quant_scale2``/``quant_offset2``) as the kernels' constexprs and the int8 scale/offset arguments."""
from __future__ import annotations

import torch

from ..problem import FIAProblem
from .codes import OUT_CAST, OUT_CAST_ROUND, OUT_INT8


def output_args(p: FIAProblem, dummy: torch.Tensor) -> tuple[list, tuple[int, int], dict]:
    """``([scale, offset], (head stride, channel stride), constexprs)`` of ``rounding.output_tile``: the int8 output's
    scale and offset (``dummy`` where unused; strides 0 for a per-tensor ``[1, 1]`` scale, else those of ``[N1,
    Dv]``) and ``OUT_MODE`` / ``OUT_OFFSET``."""
    quant = p.out_quant
    if quant is None:
        mode = OUT_CAST if p.out_dtype == torch.float32 else OUT_CAST_ROUND
        return [dummy, dummy], (0, 0), dict(OUT_MODE=mode, OUT_OFFSET=False)
    scale = quant.scale
    strides = (scale.stride(0) if scale.shape[0] > 1 else 0, scale.stride(1) if scale.shape[1] > 1 else 0)
    offset = dummy if quant.offset is None else quant.offset
    return [scale, offset], strides, dict(OUT_MODE=OUT_INT8, OUT_OFFSET=quant.offset is not None)
