"""The NSA kernels in the shared AOT machinery (``attnops._core.triton``): the problems ``python -m attnops aot``
compiles, from the launchers' own plans: selected attention forward and backward (GQA group 16, select blocks of
64) and compression forward and backward (blocks of 32, stride 16), fp16/bf16/fp32 x head dims 128 and 192/128."""
from __future__ import annotations

import torch

from ...._core.triton.registry import register_aot
from ..compress import build_compress_spec
from ..selected import build_selected_spec
from . import launch as nsa_launch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEAD_DIMS = ((128, 128), (192, 128))


def _selected(dtype: str, d: int, dv: int) -> list:
    """Forward and backward launches of a small causal problem (only the signature matters, not the sizes)."""
    gen = torch.Generator().manual_seed(0)
    t, n2, group, block, count = 256, 1, 16, 64, 2
    q = torch.randn(t, n2 * group, d, generator=gen).to(DTYPES[dtype])
    k = torch.randn(t, n2, d, generator=gen).to(q.dtype)
    v, dy = torch.randn(t, n2, dv, generator=gen).to(q.dtype), torch.randn(t, n2 * group, dv, generator=gen).to(q.dtype)
    topk = torch.stack([torch.randperm(t // block, generator=gen)[:count] for _ in range(t)]).to(torch.int32)
    topk = topk.reshape(t, n2, count)
    spec = build_selected_spec(q, k, v, topk, scale_value=d ** -0.5, head_num=n2 * group, select_block_size=block,
                               select_block_count=count, actual_seq_qlen=[t], actual_seq_kvlen=[t], grad=True)
    (out, smax, ssum), fwd = nsa_launch.selected_forward_plan(spec, q, k, v, topk, interpret=False)
    _, bwd = nsa_launch.selected_backward_plan(spec, q, k, v, out, dy, smax, ssum, topk, interpret=False)
    return [nsa_launch.KERNELS.aot_launch(item) for item in fwd + bwd]


def _compress(dtype: str, d: int) -> list:
    """Forward and backward launches of a two-sequence compression."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 4, d, generator=gen).to(DTYPES[dtype])
    w = torch.randn(32, 4, generator=gen).to(x.dtype)
    spec = build_compress_spec(x, w, compress_block_size=32, compress_stride=16, actual_seq_len=[90, 200])
    out, fwd = nsa_launch.compress_forward_plan(spec, x, w, interpret=False)
    _, bwd = nsa_launch.compress_backward_plan(spec, torch.randn(out.shape, generator=gen).to(x.dtype), x, w,
                                               interpret=False)
    return [nsa_launch.KERNELS.aot_launch(item) for item in fwd + bwd]


for _dtype in DTYPES:
    for _d, _dv in HEAD_DIMS:
        register_aot("nsa", f"selected-{_dtype}-d{_d}-dv{_dv}",
                     lambda dtype=_dtype, d=_d, dv=_dv: _selected(dtype, d, dv))
    for _d in sorted({d for d, _ in HEAD_DIMS}):
        register_aot("nsa", f"compress-{_dtype}-d{_d}", lambda dtype=_dtype, d=_d: _compress(dtype, d))
