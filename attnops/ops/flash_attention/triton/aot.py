"""The FlashAttention kernels in the shared AOT machinery (``attnops._core.triton``): a plan's launches as
:class:`~attnops._core.triton.aot.KernelLaunch` call sites, and the problems ``python -m attnops aot`` compiles
(every kernel and every tile class: fp16/bf16/fp32 x head dims 64/128/256, plus one problem with every
per-element feature: explicit mask, pse with its gradient, Philox dropout, and one with ``cu_seqlens`` tensors for
the prepare and tail kernels)."""
from __future__ import annotations

import torch

from ...._core.triton.aot import KernelLaunch
from ...._core.triton.registry import register_aot
from ..problem import build_problem
from . import launch as fa_launch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _plan(dtype: str, d: int, everything: bool, device_lengths: bool = False) -> list[KernelLaunch]:
    """Forward and backward launches of a small BNSD problem, or a TND one with ``cu_seqlens`` tensors (the prepare
    and tail kernels too); only the signature matters, not the sizes."""
    gen = torch.Generator().manual_seed(0)
    b, n, s, t = 2, 4, 40, DTYPES[dtype]
    q, k, v, dy = (torch.randn(b, n, s, d, generator=gen).to(t) for _ in range(4))
    kw = dict(layout="BNSD", head_num=n, scale=d ** -0.5)
    if device_lengths:
        q, k, v, dy = (x.transpose(1, 2).reshape(b * s, n, d) for x in (q, k, v, dy))
        cu = torch.tensor([0, s, b * s], dtype=torch.int32)
        kw.update(layout="TND", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s)
    if everything:
        kw.update(atten_mask=torch.rand(b, n, s, s, generator=gen) < 0.3, sparse_mode=0,
                  pse=torch.randn(1, n, s, s, generator=gen).to(t), pse_type=1, keep_prob=0.9, seed=7, offset=0)
    else:
        kw.update(atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1), sparse_mode=3)
    p = build_problem(q, k, v, **kw)
    (out, smax, ssum), fwd = fa_launch.forward_plan(p, q, k, v, interpret=False)
    _, bwd = fa_launch.backward_plan(p, q, k, v, dy, out, smax, ssum, interpret=False)
    return [fa_launch.KERNELS.aot_launch(item) for item in fwd + bwd]


for _dtype in DTYPES:
    for _d in (64, 128, 256):
        register_aot("flash_attention", f"{_dtype}-d{_d}-causal",
                     lambda dtype=_dtype, d=_d: _plan(dtype, d, everything=False))
register_aot("flash_attention", "bf16-d128-mask-pse-dropout", lambda: _plan("bf16", 128, everything=True))
register_aot("flash_attention", "fp16-d128-causal-device-lengths",
             lambda: _plan("fp16", 128, everything=False, device_lengths=True))
