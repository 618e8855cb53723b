"""flash-attn check cases: every function of :mod:`attnops.flash_attn` (flash-attn 2's and FlashAttention-3's
names) called as flash-attn code calls it, output, LSE and gradients against the fp64 golden (causal and windows as
the bottom-right sparse modes 3/4, ALiBi as bottom-right slopes, softcap), on the reference and on Triton."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import flash_attn
from ..testing import golden
from ..testing.compare import fa_reductions
from .case import CheckCase, Comparison, input_device, moved, on_cpu
from .flash_attention import CAUSAL_2048, INT_MAX

B, SQ, SK, H, HK, D = 2, 48, 64, 4, 2, 64


@dataclass
class FlashAttnCase:
    """One call: ``pack`` "" / "qkv" / "kv" (the packed forms need Sq == Sk and, for qkv, H == H_k), ``varlen``
    lengths (query, key) per sequence or None, flash-attn options."""

    function: str
    name: str
    options: dict = field(default_factory=dict)
    pack: str = ""
    varlen: tuple[list[int], list[int]] | None = None
    fa3: bool = False


def _golden_options(options: dict, sq: int, sk: int) -> dict:
    """The golden's CANN options of flash-attn's ``options``."""
    kw = dict(scale=D ** -0.5, softcap=options.get("softcap", 0.0))
    left, right = options.get("window_size", (-1, -1))
    if options.get("causal"):
        right = 0
    if left != -1 or right != -1:
        kw.update(atten_mask=CAUSAL_2048, sparse_mode=3 if (left, right) == (-1, 0) else 4,
                  pre_tokens=INT_MAX if left == -1 else left, next_tokens=INT_MAX if right == -1 else right)
    if options.get("alibi_slopes") is not None:
        kw.update(pse=options["alibi_slopes"], pse_type=2, pse_bottom_right=True)
    return kw


def _call(case: FlashAttnCase, q, k, v, options):
    """The case's function on unpacked ``q, k, v`` (packed here as its caller would): ``(out, lse)``."""
    module = flash_attn.fa3 if case.fa3 else flash_attn
    fn: Callable = getattr(module, case.function)
    lead = ()
    if case.varlen is not None:
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
                      for x in case.varlen)
        lens = [max(x) for x in case.varlen]
        lead = (cu_q, lens[0]) if case.pack == "qkv" else (cu_q, cu_k, *lens)
    dim = 1 if case.varlen is not None else 2
    if case.pack == "qkv":
        tensors = (torch.stack([q, k, v], dim),)
    else:
        tensors = (q, torch.stack([k, v], dim)) if case.pack == "kv" else (q, k, v)
    result = fn(*tensors, *lead, return_attn_probs=True, **options)
    return result[0], result[1]


def _run(case: FlashAttnCase, backend: str) -> list[Comparison]:
    gen = torch.Generator().manual_seed(sum(map(ord, case.name)))
    dtype = torch.float16
    sk = SQ if case.pack else SK
    hk = H if case.pack == "qkv" else HK
    if case.varlen is None:
        shapes = ((B, SQ, H, D), (B, sk, hk, D))
    else:
        shapes = ((sum(case.varlen[0]), H, D), (sum(case.varlen[1]), hk, D))
    q, k, v, dy = (torch.randn(s, generator=gen).to(dtype) for s in (shapes[0], shapes[1], shapes[1], shapes[0]))
    options = dict(case.options)
    device = input_device(backend)
    leaves = [x.to(device, copy=True).requires_grad_() for x in (q, k, v)]
    out, lse = _call(case, *leaves, moved(device, options))
    grads = torch.autograd.grad(out, leaves, dy.to(device))
    layout = "TND" if case.varlen is not None else "BSND"
    kw = dict(head_num=H, input_layout=layout, **_golden_options(options, SQ, sk))
    if case.varlen is not None:
        kw.update(actual_seq_qlen=torch.tensor(case.varlen[0]).cumsum(0).tolist(),
                  actual_seq_kvlen=torch.tensor(case.varlen[1]).cumsum(0).tolist(), softmax_layout="TND")
    gold, smax, ssum = golden.fa_forward(q, k, v, **kw)
    gold_lse = (smax[..., 0] + ssum[..., 0].log()).masked_fill(smax[..., 0] < -1e38, float("inf"))
    base = golden.fa_forward(q, k, v, dtype=dtype, **kw)[0]
    gold_grads = golden.fa_backward(dy, q, k, v, **kw)[:3]
    base_grads = golden.fa_backward(dy, q, k, v, dtype=dtype, **kw)[:3]
    lse, out, *grads = on_cpu([lse, out, *grads])
    lse_gold = gold_lse.t() if case.varlen is not None else gold_lse
    red = fa_reductions(q, k, v, layout=layout, head_num=H, actual_seq_qlen=kw.get("actual_seq_qlen"),
                        actual_seq_kvlen=kw.get("actual_seq_kvlen"))
    comparisons = [Comparison("out", out, gold, base, reduction=red["out"]),
                   Comparison("lse", lse.masked_fill(lse.isinf(), 0), lse_gold.masked_fill(lse_gold.isinf(), 0),
                              None, reduction=red["lse"])]
    return comparisons + [Comparison(n, a, g, b_, 3.0, red[n]) for n, a, g, b_ in
                          zip(("dq", "dk", "dv"), grads, gold_grads, base_grads)]


VARLEN = ([17, 0, 31], [20, 9, 31])


def flash_attn_cases() -> list[FlashAttnCase]:
    alibi = torch.rand(H, generator=torch.Generator().manual_seed(1))
    return [
        FlashAttnCase("flash_attn_func", "causal softcap alibi GQA Sq<Sk",
                      dict(causal=True, softcap=20.0, alibi_slopes=alibi)),
        FlashAttnCase("flash_attn_func", "window (8, 4) GQA Sq<Sk", dict(window_size=(8, 4))),
        FlashAttnCase("flash_attn_varlen_func", "causal window softcap alibi, empty sequence",
                      dict(causal=True, window_size=(12, -1), softcap=20.0, alibi_slopes=alibi), varlen=VARLEN),
        FlashAttnCase("flash_attn_qkvpacked_func", "causal", dict(causal=True), pack="qkv"),
        FlashAttnCase("flash_attn_kvpacked_func", "softcap GQA", dict(softcap=20.0), pack="kv"),
        FlashAttnCase("flash_attn_varlen_qkvpacked_func", "causal", dict(causal=True), pack="qkv",
                      varlen=(VARLEN[1], VARLEN[1])),
        FlashAttnCase("flash_attn_varlen_kvpacked_func", "window alibi", dict(window_size=(6, 6), alibi_slopes=alibi),
                      pack="kv", varlen=(VARLEN[1], VARLEN[1])),
        FlashAttnCase("flash_attn_func", "causal softcap (FA3)", dict(causal=True, softcap=20.0), fa3=True),
        FlashAttnCase("flash_attn_varlen_func", "causal (FA3)", dict(causal=True), varlen=VARLEN, fa3=True),
        FlashAttnCase("flash_attn_qkvpacked_func", "window (FA3)", dict(window_size=(5, 5)), pack="qkv", fa3=True),
    ]


def cases() -> list[CheckCase]:
    return [CheckCase(f"attnops.flash_attn.{'fa3.' if c.fa3 else ''}{c.function}", c.name,
                      (lambda backend, c=c: _run(c, backend)), ("reference", "triton"))
            for c in flash_attn_cases()]
