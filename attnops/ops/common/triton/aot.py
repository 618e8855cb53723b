"""The FlashAttention kernels in the shared AOT machinery (``attnops._core.triton``): a plan's launches as
:class:`~attnops._core.triton.aot.KernelLaunch` call sites, and the problems ``python -m attnops aot`` compiles:
fp16/bf16/fp32 x head dims 64/128/256 causal (every tile class), fp16/bf16 at D=64/128 with each mask and
per-element feature alone (none, causal, band, explicit mask, each pse kind, each dropout kind, softcap) and all of
them at once (also at D=192/Dv=128 and D=256), GQA and MQA, D=192/Dv=128 causal, causal + softcap + slopes, the
backward's form for GPUs before sm_90 (``-dq-kernel``: its dK/dV pass and dQ kernel compile for sm_80 only, the one
pass for sm_90 only), and one problem with ``cu_seqlens`` tensors for the prepare and tail kernels. Sequence lengths
are multiples of 16, as in real training shapes, so the row strides of a pse or an explicit mask get Triton's
divisible-by-16 specialisation (only the signature matters, not the sizes)."""
from __future__ import annotations

import dataclasses

import torch

from ...._core.dropout import pack_bits
from ...._core.triton.aot import KernelLaunch
from ...._core.triton.registry import register_aot
from ..problem import build_problem
from . import launch as fa_launch
from .autotune import KERNELS

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# one problem per feature (each alone) at fp16/bf16 x D 64/128; "all": explicit mask + full pse + Philox dropout
FEATURES = ("plain", "causal", "band", "explicit", "pse_full0", "pse_full1", "pse_row", "alibi", "slopes2",
            "slopes3", "drop_seed", "drop_packed", "softcap")
EVERYTHING = ("explicit", "pse_full1", "drop_seed")


def _feature_kwargs(features: tuple[str, ...], b: int, n: int, s: int, dtype: torch.dtype,
                    gen: torch.Generator) -> dict:
    """``build_problem`` options of the named features on a ``[b, n, s, s]`` score."""
    kw = {}
    if "causal" in features or "alibi" in features:  # the compressed ALiBi pse needs a causal mask
        kw.update(atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1), sparse_mode=3)
    if "band" in features:
        kw.update(atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1), sparse_mode=4, pre_tokens=100,
                  next_tokens=20)
    if "explicit" in features:
        kw.update(atten_mask=torch.rand(b, n, s, s, generator=gen) < 0.3, sparse_mode=0)
    for name, pse_type, rows in (("pse_full0", 0, s), ("pse_full1", 1, s), ("pse_row", 1, 1), ("alibi", 1, 1024)):
        if name in features:
            kw.update(pse=torch.randn(1, n, rows, s, generator=gen).to(dtype), pse_type=pse_type)
    for name, pse_type in (("slopes2", 2), ("slopes3", 3)):
        if name in features:
            kw.update(pse=torch.rand(b, n, generator=gen), pse_type=pse_type)
    if "softcap" in features:
        kw.update(softcap=30.0)
    if "drop_seed" in features:
        kw.update(keep_prob=0.9, seed=7, offset=0)
    if "drop_packed" in features:
        kw.update(keep_prob=0.9, drop_mask=pack_bits(torch.rand(b * n * s * s, generator=gen) < 0.9))
    return kw


def _plan(dtype: str, d: int, features: tuple[str, ...], dv: int | None = None, n2: int = 2,
          device_lengths: bool = False, fused: bool = True) -> list[KernelLaunch]:
    """Forward and backward launches of a small BNSD problem with ``features`` (4 query heads on ``n2`` KV heads: GQA by default),
    or a TND one with ``cu_seqlens`` tensors (the prepare and tail kernels too); ``fused`` False: the backward of
    GPUs before sm_90 (the dQ kernel beside the dK/dV pass)."""
    gen = torch.Generator().manual_seed(0)
    b, n1, t = 2, 4, DTYPES[dtype]
    s = 1040 if "alibi" in features else 128  # the compressed ALiBi pse is for Sq > 1024 in dense layouts
    dv = d if dv is None else dv
    q, dy = (torch.randn(b, n1, s, dim, generator=gen).to(t) for dim in (d, dv))
    k, v = (torch.randn(b, n2, s, dim, generator=gen).to(t) for dim in (d, dv))
    kw = dict(layout="BNSD", head_num=n1, scale=d ** -0.5)
    if device_lengths:
        q, k, v, dy = (x.transpose(1, 2).reshape(b * s, x.shape[1], x.shape[3]) for x in (q, k, v, dy))
        cu = torch.tensor([0, s, b * s], dtype=torch.int32)
        kw.update(layout="TND", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s)
    kw.update(_feature_kwargs(features, b, n1, s, t, gen))
    p = build_problem(q, k, v, **kw)
    (out, smax, ssum), fwd = fa_launch.forward_plan(p, q, k, v, interpret=False)
    _, bwd = fa_launch.backward_plan(p, q, k, v, dy, out, smax, ssum, interpret=False, fused=fused)
    return [_on_targets(KERNELS.aot_launch(item), fused) for item in fwd + bwd]


def _on_targets(launch: KernelLaunch, fused: bool) -> KernelLaunch:
    """``launch`` on the targets that run it: the backward's dK/dV pass and dQ kernel have one form per target
    (``launch.dq_in_pass``: dQ in the pass from sm_90 on, the dQ kernel before)."""
    if launch.kernel not in ("dkdv_kernel", "dq_kernel"):
        return launch
    return dataclasses.replace(launch, targets=("sm_90",) if fused else ("sm_80",))


def _register(name: str, dtype: str, d: int, features: tuple[str, ...], **kw) -> None:
    register_aot("flash_attention", name, lambda: _plan(dtype, d, features, **kw))


for _dtype in DTYPES:
    for _d in (64, 128, 256):
        _register(f"{_dtype}-d{_d}-causal", _dtype, _d, ("causal",))
for _dtype in ("fp16", "bf16"):
    for _d in (64, 128):
        for _feature in FEATURES:
            if _feature != "causal":
                _register(f"{_dtype}-d{_d}-{_feature}", _dtype, _d, (_feature,))
        _register(f"{_dtype}-d{_d}-mask-pse-dropout", _dtype, _d, EVERYTHING)
        _register(f"{_dtype}-d{_d}-causal-mha", _dtype, _d, ("causal",), n2=4)
        _register(f"{_dtype}-d{_d}-causal-mqa", _dtype, _d, ("causal",), n2=1)
        for _features in (("causal",), EVERYTHING):
            _register(f"{_dtype}-d{_d}-{'-'.join(_features)}-dq-kernel", _dtype, _d, _features, fused=False)
    _register(f"{_dtype}-d192-dv128-causal", _dtype, 192, ("causal",), dv=128)
    _register(f"{_dtype}-d192-dv128-mask-pse-dropout", _dtype, 192, EVERYTHING, dv=128)
    _register(f"{_dtype}-d256-mask-pse-dropout", _dtype, 256, EVERYTHING)
_register("fp32-d128-mask-pse-dropout", "fp32", 128, EVERYTHING)
_register("fp32-d128-causal-dq-kernel", "fp32", 128, ("causal",), fused=False)
_register("fp16-d128-causal-device-lengths", "fp16", 128, ("causal",), device_lengths=True)
_register("bf16-d128-causal-softcap-slopes2", "bf16", 128, ("causal", "softcap", "slopes2"))
_register("bf16-d128-causal-softcap-slopes2-dq-kernel", "bf16", 128, ("causal", "softcap", "slopes2"), fused=False)
