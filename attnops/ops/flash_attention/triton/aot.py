"""The FlashAttention kernels in the shared AOT machinery (``attnops._core.triton``): a plan's launches as
:class:`~attnops._core.triton.aot.KernelLaunch` call sites, and the problems ``python -m attnops aot`` compiles:
every kernel and every tile class (fp16/bf16/fp32 x head dims 64/128/256, causal), fp16/bf16 at D=64 and 128 with
each feature alone (no mask, band, explicit mask, pse with its gradient, Philox dropout) and all of them at once,
GQA and MQA, D=192/Dv=128, the backward's form for GPUs before sm_90 (``-dq-kernel``), and one problem with
``cu_seqlens`` tensors for the prepare and tail kernels."""
from __future__ import annotations

import torch

from ...._core.triton.aot import KernelLaunch
from ...._core.triton.registry import register_aot
from ..problem import build_problem
from . import launch as fa_launch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
S = 40  # tokens per sequence: only the signature matters, not the sizes


def _features(name: str, n: int, gen: torch.Generator, t: torch.dtype) -> dict:
    """The call's keywords of one feature (``everything``: explicit mask, pse with its gradient and dropout)."""
    triu = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    mask = dict(atten_mask=torch.rand(2, n, S, S, generator=gen) < 0.3, sparse_mode=0)
    pse = dict(pse=torch.randn(1, n, S, S, generator=gen).to(t), pse_type=1)
    dropout = dict(keep_prob=0.9, seed=7, offset=0)
    return {"plain": {}, "causal": dict(atten_mask=triu, sparse_mode=3),
            "band": dict(atten_mask=triu, sparse_mode=4, pre_tokens=9, next_tokens=2), "mask": mask, "pse": pse,
            "dropout": dropout, "everything": {**mask, **pse, **dropout}}[name]


def _plan(dtype: str, d: int, feature: str, dv: int | None = None, n2: int = 4, device_lengths: bool = False,
          fused: bool = True) -> list[KernelLaunch]:
    """Forward and backward launches of a small BNSD problem (4 query heads, ``n2`` KV heads), or a TND one with
    ``cu_seqlens`` tensors (the prepare and tail kernels too); ``fused`` False: the backward of GPUs before sm_90
    (the dQ kernel beside the dK/dV pass)."""
    gen = torch.Generator().manual_seed(0)
    b, n, t, dv = 2, 4, DTYPES[dtype], d if dv is None else dv
    q, dy = (torch.randn(b, n, S, dk, generator=gen).to(t) for dk in (d, dv))
    k, v = (torch.randn(b, n2, S, dk, generator=gen).to(t) for dk in (d, dv))
    kw = dict(layout="BNSD", head_num=n, scale=d ** -0.5)
    if device_lengths:
        q, k, v, dy = (x.transpose(1, 2).reshape(b * S, x.shape[1], x.shape[3]) for x in (q, k, v, dy))
        cu = torch.tensor([0, S, b * S], dtype=torch.int32)
        kw.update(layout="TND", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=S, max_seqlen_k=S)
    kw.update(_features(feature, n, gen, t))
    p = build_problem(q, k, v, **kw)
    (out, smax, ssum), fwd = fa_launch.forward_plan(p, q, k, v, interpret=False)
    _, bwd = fa_launch.backward_plan(p, q, k, v, dy, out, smax, ssum, interpret=False, fused=fused)
    return [fa_launch.KERNELS.aot_launch(item) for item in fwd + bwd]


def _register(name: str, *args, **kwargs) -> None:
    register_aot("flash_attention", name, lambda: _plan(*args, **kwargs))


for _dtype in DTYPES:
    for _d in (64, 128, 256):
        _register(f"{_dtype}-d{_d}-causal", _dtype, _d, "causal")
for _dtype in ("fp16", "bf16"):
    for _d in (64, 128):
        for _feature in ("plain", "band", "mask", "pse", "dropout", "everything"):
            _register(f"{_dtype}-d{_d}-{_feature}", _dtype, _d, _feature)
        _register(f"{_dtype}-d{_d}-causal-gqa", _dtype, _d, "causal", n2=2)
        _register(f"{_dtype}-d{_d}-causal-mqa", _dtype, _d, "causal", n2=1)
    _register(f"{_dtype}-d192-dv128-causal", _dtype, 192, "causal", dv=128)
    for _d in (64, 128):
        for _feature in ("causal", "everything"):
            _register(f"{_dtype}-d{_d}-{_feature}-dq-kernel", _dtype, _d, _feature, fused=False)
_register("fp16-d128-causal-device-lengths", "fp16", 128, "causal", device_lengths=True)
