"""``torch_npu._npu_paged_attention_quant`` (ATB PagedAttention with ``quant_type`` 3, TYPE_QUANT_QKV_ONLINE):
decode over int8 paged caches with an int8 query, per-head dequantization and the online int8 quantization of the
probabilities, in fp32.

Token ``i``, head ``h`` (KV head ``g``): ``S = scale * k_descale[h] * (q_i . K_g)`` over the first
``context_lens[i]`` cached tokens, ``P = exp(S - max S)``, ``P8 = rint(P / (max P / 127))`` (int8),
``out = v_descale[h] * (max P / 127) * (P8 . V_g) / sum P``; written into ``out`` in ``outdata_type`` (ACL dtype
1 = float16, 27 = bfloat16)."""
from __future__ import annotations

import itertools

import torch
from torch import Tensor

from .._core.checks import check_int, check_scale, check_tensor, int_list, require
from ._common import with_overloads
from .atb import _write
from .kv_cache import gather_sequences

QUANT_QKV_ONLINE = 3
ACL_OUT_DTYPES = {1: torch.float16, 27: torch.bfloat16}


def _npu_paged_attention_quant(query: Tensor, key_cache: Tensor, value_cache: Tensor, num_kv_heads: int,
                               num_heads: int, scale_value: float, block_table: Tensor, context_lens,
                               quant_type: int, outdata_type: int, k_descale: Tensor, v_descale: Tensor,
                               out: Tensor) -> None:
    """Module docstring: query ``[T, num_heads, D]`` int8, caches ``[num_blocks, block_size, num_kv_heads, D]``
    int8, ``k_descale``/``v_descale`` fp32 ``[num_heads]``, ``out [T, num_heads, D]``."""
    require(quant_type == QUANT_QKV_ONLINE, "quant_type", "3 (TYPE_QUANT_QKV_ONLINE)", quant_type)
    require(outdata_type in ACL_OUT_DTYPES, "outdata_type", "1 (ACL_FLOAT16) or 27 (ACL_BF16)", outdata_type)
    heads = check_int("num_heads", num_heads, lo=1)
    kv_heads = check_int("num_kv_heads", num_kv_heads, lo=1)
    check_tensor("query", query, ndim=3, shape=(None, heads, None), dtypes=(torch.int8,))
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_tensor(name, cache, ndim=4, shape=(None, None, kv_heads, None), dtypes=(torch.int8,),
                     device=query.device)
    for name, descale in (("k_descale", k_descale), ("v_descale", v_descale)):
        check_tensor(name, descale, shape=(heads,), dtypes=(torch.float32,), device=query.device)
    require(heads % kv_heads == 0, "num_heads", f"a multiple of num_kv_heads={kv_heads}", heads)
    lens = int_list("context_lens", context_lens)
    require(len(lens) == query.shape[0], "context_lens", f"one length per query token ({query.shape[0]})", lens)
    keys, values = gather_sequences(key_cache, value_cache, block_table, lens)
    scale = check_scale("scale_value", scale_value)
    group = heads // kv_heads
    rows = []
    for i, (start, n) in enumerate(zip(itertools.accumulate([0, *lens]), lens)):
        k = keys[start:start + n].float().repeat_interleave(group, dim=1).transpose(0, 1)  # [N, n, D]
        v = values[start:start + n].float().repeat_interleave(group, dim=1).transpose(0, 1)
        s = torch.einsum("nd,nkd->nk", query[i].float(), k) * k_descale.view(-1, 1) * scale
        p = (s - s.amax(-1, keepdim=True)).exp()
        step = p.amax(-1, keepdim=True) / 127.0
        p8 = (p / step).half().round().clamp(-128, 127).float()  # the kernel: fp32 -> fp16 -> int8
        rows.append(torch.einsum("nk,nkd->nd", p8, v) * (v_descale.view(-1, 1) * step) / p.sum(-1, keepdim=True))
    _write(out, torch.stack(rows).to(ACL_OUT_DTYPES[outdata_type]))


_npu_paged_attention_quant = with_overloads(_npu_paged_attention_quant)
