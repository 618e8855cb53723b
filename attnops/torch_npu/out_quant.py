"""FusedInferAttention v2's ``out_dtype`` with ``quant_scale_out``: the output quantized as
``cast(O * quant_scale_out + quant_offset_out, out_dtype)`` into an 8-bit float (``torch.float8_e4m3fn``,
``torch.float8_e5m2``, or ``torch_npu.hifloat8`` codes in ``torch.uint8``). Values beyond the format's largest
finite magnitude saturate to it (the NPU's saturating cast); int8, the default, stays with the operator's own
quantization."""
from __future__ import annotations

import torch
from torch import Tensor

from .._core import hifloat8
from .._core.checks import check_tensor, require

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.int8, *FLOAT8_DTYPES, hifloat8.HIFLOAT8)


def check_out_dtype(out_dtype, quant_scale_out) -> None:
    """``out_dtype``: None, or with ``quant_scale_out`` one of :data:`OUT_DTYPES` (without it, a float query's output
    keeps the query's dtype and ``out_dtype`` is ignored, as on the NPU)."""
    if out_dtype is None or quant_scale_out is None:
        return
    require(out_dtype in OUT_DTYPES, "out_dtype", "torch.int8, torch.float8_e4m3fn, torch.float8_e5m2 or "
            "torch_npu.hifloat8 (with quant_scale_out)", out_dtype)


def _channel_view(param: Tensor, layout: str, heads: int) -> Tensor:
    """A per-tensor or per-channel (``heads * D`` elements) parameter broadcastable over an output in ``layout``
    (the part after ``_`` for a dual layout)."""
    if param.numel() == 1:
        return param.reshape(()).float()
    out_layout = layout.split("_")[-1]
    nd = param.float().reshape(heads, -1)
    views = {"BNSD": (1, heads, 1, -1), "BSND": (1, 1, heads, -1), "TND": (1, heads, -1), "NTD": (heads, 1, -1),
             "BSH": (1, 1, -1), "SBH": (1, 1, -1)}
    require(out_layout in views, "input_layout", f"one of {sorted(views)} for a per-channel quant_scale_out", layout)
    return nd.reshape(views[out_layout])


def quantize_output(out: Tensor, quant_scale_out: Tensor, quant_offset_out: Tensor | None, out_dtype, layout: str,
                    heads: int) -> Tensor:
    """``out`` (the unquantized attention output) as ``out_dtype`` (an 8-bit float of :data:`FLOAT8_DTYPES` or
    HiFloat8 codes)."""
    check_tensor("quant_scale_out", quant_scale_out, dtypes=(torch.float32, torch.bfloat16))
    y = out.float() * _channel_view(quant_scale_out, layout, heads)
    if quant_offset_out is not None:
        check_tensor("quant_offset_out", quant_offset_out, shape=tuple(quant_scale_out.shape))
        y = y + _channel_view(quant_offset_out, layout, heads)
    if out_dtype is hifloat8.HIFLOAT8:
        return hifloat8.encode(y)
    limit = torch.finfo(out_dtype).max
    return torch.where(y.isnan(), y, y.clamp(-limit, limit)).to(out_dtype)
