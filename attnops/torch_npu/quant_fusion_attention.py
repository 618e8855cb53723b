"""``torch_npu.npu_quant_fusion_attention``: FlashAttention on 8-bit float inputs with per-block dequantization
scales (Ascend950's FP8 / HiFloat8 FlashAttentionScore), in fp32 on the stand-in.

``query``/``key``/``value`` are ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` tensors, or HiFloat8 codes in
``torch.uint8`` with ``query_dtype=torch_npu.hifloat8``; layout BNSD, BSND or BSH. ``d_scale_q/k/v [B, N, blocks, 1]``
fp32 dequantize blocks of 128 query, 256 key and 512 value positions along the sequence (token ``s`` of head ``n``
uses ``d_scale[b, n, s // block, 0]``). The attention is ``O = (P V~) / rowsum(P)`` with
``P = fp8_e4m3fn(exp(S - rowmax(S)))`` and ``S = scale * Q~ K~^T`` (``~``: dequantized): the probabilities are
rounded to FP8 before both the sum and the second matmul, as the kernel feeds them to its FP8 matmul. ``p_scale``
is accepted (its shape checked) and does not enter the result. Output fp16, in the input layout."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .._core import hifloat8
from .._core.checks import check_int, check_scale, check_tensor, require
from ._common import with_overloads

BLOCKS = {"query": 128, "key": 256, "value": 512}
FP8_INPUTS = (torch.float8_e4m3fn, torch.float8_e5m2)
_TO_BNSD = {"BNSD": lambda x, n: x, "BSND": lambda x, n: x.transpose(1, 2),
            "BSH": lambda x, n: x.view(x.shape[0], x.shape[1], n, -1).transpose(1, 2)}


def _dequantized(name: str, x: Tensor, d_scale: Tensor, layout: str, heads: int, hif8: bool) -> Tensor:
    """``x`` as fp32 ``[B, N, S, D]`` with its per-block scale applied."""
    check_tensor(name, x, ndim=4 if layout != "BSH" else 3, dtypes=(torch.uint8,) if hif8 else FP8_INPUTS)
    values = hifloat8.decode(x) if hif8 else x.float()
    values = _TO_BNSD[layout](values, heads)
    b, n, s, _ = values.shape
    blocks = math.ceil(s / BLOCKS[name])
    check_tensor(f"d_scale_{name[0]}", d_scale, shape=(b, n, blocks, 1), dtypes=(torch.float32,),
                 device=x.device)
    per_token = d_scale.repeat_interleave(BLOCKS[name], dim=2)[:, :, :s]
    return values * per_token


def npu_quant_fusion_attention(query: Tensor, key: Tensor, value: Tensor, head_num: int, input_layout: str, *,
                               d_scale_q: Tensor, d_scale_k: Tensor, d_scale_v: Tensor,
                               p_scale: Tensor | None = None, scale: float = 1., query_dtype=None):
    """``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)`` as
    :func:`npu_fusion_attention`: ``attention_out`` fp16 in ``input_layout``, the fp32 row max and row sum of the
    (FP8-rounded) probabilities ``[B, N, S, 8]``, an empty ``softmax_out`` and zeros (no dropout)."""
    heads = check_int("head_num", head_num, lo=1)
    require(input_layout in _TO_BNSD, "input_layout", f"one of {sorted(_TO_BNSD)}", input_layout)
    require(query_dtype in (None, hifloat8.HIFLOAT8), "query_dtype", "None or torch_npu.hifloat8", query_dtype)
    if p_scale is not None:
        check_tensor("p_scale", p_scale, shape=(1,), dtypes=(torch.float32,))
    hif8 = query_dtype is hifloat8.HIFLOAT8
    q = _dequantized("query", query, d_scale_q, input_layout, heads, hif8)
    k = _dequantized("key", key, d_scale_k, input_layout, heads, hif8)
    v = _dequantized("value", value, d_scale_v, input_layout, heads, hif8)
    require(q.shape[1] % k.shape[1] == 0, "key", f"a number of heads dividing head_num={heads}", key)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * check_scale("scale", scale)
    row_max = scores.amax(-1, keepdim=True)
    probs = (scores - row_max).exp().to(torch.float8_e4m3fn).float()
    row_sum = probs.sum(-1, keepdim=True)
    out = ((probs @ v) / row_sum).half()
    if input_layout == "BSND":
        out = out.transpose(1, 2).contiguous()
    elif input_layout == "BSH":
        out = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)
    stats = (row_max.expand(*row_max.shape[:3], 8).contiguous(), row_sum.expand(*row_sum.shape[:3], 8).contiguous())
    return out, *stats, query.new_empty(0, dtype=torch.float16), 0, 0, 0


npu_quant_fusion_attention = with_overloads(npu_quant_fusion_attention)
