"""The NSA compressed-attention score kernel and the decode kernels in the shared AOT machinery: small problems
whose plans give the call sites ``python -m attnops aot`` compiles (fp16/bf16/fp32, head dims 128 and 192/128, an
explicit mask for the score kernel)."""
from __future__ import annotations

import torch

from ...._core.triton.registry import register_aot
from ...flash_attention.triton import launch as fa_launch
from ..compress_attention import build_compress_attention_spec
from ..decode import CompressSelection, PagedKV
from . import infer_launch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _compress_attention(dtype: str, d: int, dv: int) -> list:
    """The attention forward and score launches of a two-batch TND problem with the NSA causal mask."""
    t, gen = DTYPES[dtype], torch.Generator().manual_seed(0)
    q = torch.randn(96, 16, d, generator=gen).to(t)
    k = torch.randn(20, 4, d, generator=gen).to(t)
    v = torch.randn(20, 4, dv, generator=gen).to(t)
    mask = torch.rand(64, 12, generator=gen) < 0.3
    spec = build_compress_attention_spec(q, k, v, scale_value=d ** -0.5, head_num=16, compress_block_size=32,
                                         compress_stride=16, select_block_size=64, select_block_count=2,
                                         atten_mask=mask, actual_seq_qlen=[32, 96], actual_cmp_seq_kvlen=[8, 20],
                                         actual_sel_seq_kvlen=[2, 5], sparse_mode=0)
    (out, smax, ssum), fwd = fa_launch.forward_plan(spec.fa, q, k, v, interpret=False)
    _, scores = infer_launch.importance_plan(spec, q, k, smax, ssum, interpret=False)
    return [fa_launch.KERNELS.aot_launch(x) for x in fwd] + [infer_launch.KERNELS.aot_launch(x) for x in scores]


def _decode(dtype: str, d: int, dv: int) -> list:
    """The selected and compressed decode launches of two requests over a paged cache (64 query / 4 KV heads)."""
    t, gen = DTYPES[dtype], torch.Generator().manual_seed(0)
    q = torch.randn(2, 64, d, generator=gen).to(t)
    k = torch.randn(8, 16, 4, d, generator=gen).to(t)
    v = torch.randn(8, 16, 4, dv, generator=gen).to(t)
    table = torch.arange(8, dtype=torch.int32).reshape(2, 4)
    kv = PagedKV(2, 64, 4, dv, [64, 50], d ** -0.5)
    topk = torch.zeros(2, 4, 2, dtype=torch.int32)
    _, sel = infer_launch.selected_decode_plan(kv, 32, q, k, v, topk, table, interpret=False)
    _, cmp = infer_launch.compress_decode_plan(kv, CompressSelection(32, 16, 64, 3), q, k, v, table, interpret=False)
    return [infer_launch.KERNELS.aot_launch(x) for x in sel + cmp]


for _dtype in DTYPES:
    for _d, _dv in ((128, 128), (192, 128)):
        register_aot("nsa", f"compress-attention-{_dtype}-d{_d}-dv{_dv}",
                     lambda dtype=_dtype, d=_d, dv=_dv: _compress_attention(dtype, d, dv))
        register_aot("nsa", f"decode-{_dtype}-d{_d}-dv{_dv}", lambda dtype=_dtype, d=_d, dv=_dv: _decode(dtype, d, dv))
