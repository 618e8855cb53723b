"""Built-in FlashAttention check cases: every aclnn operator and the Pythonic API against the fp64 golden, on the
reference and (where its kernels serve the case) on Triton, with the inputs on CUDA when a GPU is present."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import aclnn, flash_attention, flash_attention_backward
from .._core.dropout import pack_bits
from ..testing import golden
from ..testing.compare import fa_reductions
from .case import CheckCase, Comparison, input_device, moved, on_cpu, triton_runs_on_cuda

TRITON_MAX_HEAD_DIM = 256

INT_MAX = 2147483647
CAUSAL_2048 = torch.ones(2048, 2048, dtype=torch.bool).triu(1)


def _prefix_mask() -> torch.Tensor:
    rect = torch.zeros(1024, 2048, dtype=torch.bool)
    rect[:, 1024:] = True
    return torch.cat([CAUSAL_2048, rect])


@dataclass
class FACase:
    """Inputs of one case; ``api`` picks the dialect: "score" (dense aclnn), "varlen", "varlen_v2", "python"."""

    name: str
    api: str
    layout: str
    q_shape: tuple
    k_shape: tuple
    v_shape: tuple
    head_num: int
    dtype: torch.dtype = torch.float32
    opts: dict = field(default_factory=dict)  # golden keyword options (pse, atten_mask, sparse_mode, ...)
    keep_prob: float = 1.0


def _run(case: FACase, backend: str, call: Callable | None = None) -> list[Comparison]:
    """Compare ``call(case, backend, q, k, v, dy, scale, drop_mask, opts) -> ((out, max, sum), grads)`` (default:
    the aclnn / Pythonic dialects) with the golden."""
    gen = torch.Generator().manual_seed(hash(case.name) % (2**31))
    q, k, v = (torch.randn(s, generator=gen).to(case.dtype) for s in (case.q_shape, case.k_shape, case.v_shape))
    o = dict(case.opts)
    scale = o.pop("scale", 0.125)
    gold_kw = dict(head_num=case.head_num, input_layout=case.layout, scale=scale, keep_prob=case.keep_prob, **o)
    numels = None
    drop_mask = None
    if case.keep_prob < 1.0:
        seq_q = golden.seq_lengths(o["actual_seq_qlen"]) if case.layout == "TND" else None
        seq_k = golden.seq_lengths(o["actual_seq_kvlen"]) if case.layout == "TND" else None
        if seq_q is None:
            b, sq, skv = _dense_sizes(case, q, k)
            numels = b * case.head_num * sq * skv
        else:
            numels = case.head_num * sum(a * c for a, c in zip(seq_q, seq_k))
        keep = torch.rand(numels, generator=gen) < case.keep_prob
        drop_mask = pack_bits(keep)
        gold_kw["drop_keep"] = keep
    out_g, max_g, sum_g = golden.fa_forward(q, k, v, **gold_kw)
    out_b, max_b, sum_b = golden.fa_forward(q, k, v, dtype=case.dtype, **gold_kw)
    dy = torch.randn(out_g.shape, generator=gen).to(case.dtype)
    grads_g = golden.fa_backward(dy, q, k, v, **gold_kw)
    grads_b = golden.fa_backward(dy, q, k, v, dtype=case.dtype, **gold_kw)
    dev = input_device(backend)
    outs, grads = (call or _call)(case, backend, *(moved(dev, x) for x in (q, k, v, dy)), scale, moved(dev, drop_mask),
                                  {name: moved(dev, x) for name, x in o.items()})
    outs, grads = on_cpu(outs), on_cpu(grads)
    red = fa_reductions(q, k, v, layout=case.layout, head_num=case.head_num, actual_seq_qlen=o.get("actual_seq_qlen"),
                        actual_seq_kvlen=o.get("actual_seq_kvlen"))
    names = ("attention_out", "softmax_max", "softmax_sum")
    cmps = [Comparison(n, a, g, b, reduction=red[n.removeprefix("attention_")])
            for n, a, g, b in zip(names, outs, (out_g, max_g, sum_g), (out_b, max_b, sum_b))]
    cmps += [Comparison(n, a, g, b, factor=3.0, reduction=red[n])
             for n, a, g, b in zip(("dq", "dk", "dv", "dpse"), grads, grads_g, grads_b)]
    return cmps


def _dense_sizes(case: FACase, q, k):
    if case.layout == "BNSD":
        return q.shape[0], q.shape[2], k.shape[2]
    if case.layout == "SBH":
        return q.shape[1], q.shape[0], k.shape[0]
    return q.shape[0], q.shape[1], k.shape[1]


def _call(case: FACase, backend, q, k, v, dy, scale, drop_mask, o):
    pse, mask = o.get("pse"), o.get("atten_mask")
    pre, nxt = o.get("pre_tokens", INT_MAX), o.get("next_tokens", INT_MAX)
    mode, prefix = o.get("sparse_mode", 0), o.get("prefix")
    qlen, kvlen = o.get("actual_seq_qlen"), o.get("actual_seq_kvlen")
    if case.api == "python":
        kw = dict(layout=case.layout, head_num=case.head_num, scale=scale, pse=pse, pse_type=o.get("pse_type", 1),
                  atten_mask=mask, sparse_mode=mode, pre_tokens=pre, next_tokens=nxt, prefix=prefix,
                  actual_seq_qlen=qlen, actual_seq_kvlen=kvlen, keep_prob=case.keep_prob, drop_mask=drop_mask,
                  q_start_idx=o.get("q_start_idx", 0), kv_start_idx=o.get("kv_start_idx", 0),
                  softmax_layout=o.get("softmax_layout", ""), backend=backend)
        res = flash_attention(q, k, v, return_stats=True, **kw)
        grads = flash_attention_backward(dy, q, k, v, res.out, res.softmax_max, res.softmax_sum, seed=res.seed,
                                         **kw)
        return (res.out, res.softmax_max, res.softmax_sum), grads
    common = (scale, case.keep_prob, pre, nxt, case.head_num, case.layout, 0, mode)
    if case.api == "score":
        smax, ssum, _, out = aclnn.flash_attention_score(q, k, v, pse, drop_mask, None, mask, prefix, *common)
        grads = aclnn.flash_attention_score_grad(q, k, v, dy, pse, drop_mask, None, mask, smax, ssum, None, out,
                                                 prefix, *common)
    elif case.api == "varlen":
        smax, ssum, _, out = aclnn.flash_attention_var_len_score(q, k, v, pse, drop_mask, None, mask, prefix, qlen,
                                                                 kvlen, *common)
        grads = aclnn.flash_attention_unpadding_score_grad(q, k, v, dy, pse, drop_mask, None, mask, smax, ssum, None,
                                                           out, prefix, qlen, kvlen, *common)
    else:
        starts = ([o.get("q_start_idx", 0)], [o.get("kv_start_idx", 0)])
        pse_type = o.get("pse_type", 1)
        smax, ssum, _, out = aclnn.flash_attention_var_len_score_v2(q, k, v, pse, drop_mask, None, mask, prefix,
                                                                    qlen, kvlen, *starts, *common, pse_type)
        grads = aclnn.flash_attention_unpadding_score_grad_v2(q, k, v, dy, pse, drop_mask, None, mask, smax, ssum,
                                                              None, out, prefix, qlen, kvlen, *starts, *common,
                                                              pse_type)
    return (out, smax, ssum), grads


def _tnd(t, n, d):
    return (t, n, d)


def fa_cases() -> list[FACase]:
    varlen_q, varlen_kv = [5, 5, 68, 69, 180], [7, 7, 70, 133, 200]  # a zero-length batch, length 1, 63, 111
    tq, tkv = varlen_q[-1], varlen_kv[-1]
    full_mask = torch.rand(4, 4, 40, 48, generator=torch.Generator().manual_seed(3)) < 0.25
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    return [
        FACase("BNSD full attention", "score", "BNSD", (2, 4, 40, 32), (2, 4, 48, 32), (2, 4, 48, 32), 4),
        FACase("BSH causal mode 2 fp16", "score", "BSH", (2, 64, 64), (2, 64, 64), (2, 64, 64), 4, torch.float16,
               dict(atten_mask=CAUSAL_2048, sparse_mode=2)),
        FACase("SBH GQA 4 mode 3 bf16", "score", "SBH", (40, 2, 128), (48, 2, 32), (48, 2, 32), 4, torch.bfloat16,
               dict(atten_mask=CAUSAL_2048, sparse_mode=3)),
        FACase("BSND mode 0 mask + band, pse type 1", "score", "BSND", (4, 40, 4, 16), (4, 48, 4, 16),
               (4, 48, 4, 8), 4, opts=dict(atten_mask=full_mask, sparse_mode=0, pre_tokens=10, next_tokens=5,
                                            pse=torch.randn(1, 4, 40, 48))),
        FACase("BNSD mode 4 band + dropout", "score", "BNSD", (2, 4, 40, 16), (2, 2, 48, 16), (2, 2, 48, 16), 4,
               opts=dict(atten_mask=CAUSAL_2048, sparse_mode=4, pre_tokens=6, next_tokens=2), keep_prob=0.8),
        FACase("BNSD mode 5 prefix", "score", "BNSD", (2, 2, 24, 16), (2, 2, 32, 16), (2, 2, 32, 16), 2,
               opts=dict(atten_mask=_prefix_dense(2, 24, 32, [10, 20]), sparse_mode=5, prefix=[10, 20])),
        FACase("TND varlen mode 3, GQA 4, Dk>Dv", "varlen", "TND", _tnd(tq, 8, 32), _tnd(tkv, 2, 32),
               _tnd(tkv, 2, 16), 8, opts=dict(atten_mask=CAUSAL_2048, sparse_mode=3, actual_seq_qlen=varlen_q,
                                              actual_seq_kvlen=varlen_kv)),
        FACase("TND mode 6 prefix", "varlen", "TND", _tnd(50, 2, 16), _tnd(70, 2, 16), _tnd(70, 2, 16), 2,
               opts=dict(atten_mask=_prefix_mask(), sparse_mode=6, prefix=[15, 38], actual_seq_qlen=[20, 50],
                         actual_seq_kvlen=[30, 70])),
        FACase("TND mode 7 (doc example card 1)", "varlen", "TND", _tnd(5, 2, 16), _tnd(9, 2, 16), _tnd(9, 2, 16), 2,
               opts=dict(atten_mask=CAUSAL_2048, sparse_mode=7, pre_tokens=6, next_tokens=-2, actual_seq_qlen=[3, 5],
                         actual_seq_kvlen=[3, 9])),
        FACase("TND mode 8 (doc example card 2)", "varlen", "TND", _tnd(12, 2, 16), _tnd(13, 2, 16),
               _tnd(13, 2, 16), 2, opts=dict(atten_mask=CAUSAL_2048, sparse_mode=8, pre_tokens=4, next_tokens=1,
                                             actual_seq_qlen=[3, 8, 12], actual_seq_kvlen=[4, 9, 13])),
        FACase("TND mode 1 fully-masked rows", "varlen", "TND", _tnd(30, 2, 16), _tnd(30, 2, 16), _tnd(30, 2, 16), 2,
               opts=dict(atten_mask=_rows_masked(20, 20, [0, 7]), sparse_mode=1, actual_seq_qlen=[10, 30],
                         actual_seq_kvlen=[10, 30])),
        FACase("TND V2 ALiBi pse_type 2, start idx", "varlen_v2", "TND", _tnd(40, 4, 16), _tnd(40, 4, 16),
               _tnd(40, 4, 16), 4, opts=dict(atten_mask=CAUSAL_2048, sparse_mode=3, pse=slopes, pse_type=2,
                                             q_start_idx=32, kv_start_idx=32, actual_seq_qlen=[16, 40],
                                             actual_seq_kvlen=[16, 40])),
        FACase("TND V2 sqrt ALiBi pse_type 3, D=640", "varlen_v2", "TND", _tnd(24, 2, 640), _tnd(24, 2, 640),
               _tnd(24, 2, 64), 2, opts=dict(pse=slopes[:2], pse_type=3, actual_seq_qlen=[8, 24],
                                             actual_seq_kvlen=[8, 24])),
        FACase("TND V2 pse_type 0 + dropout", "varlen_v2", "TND", _tnd(30, 2, 16), _tnd(36, 2, 16), _tnd(36, 2, 16),
               2, opts=dict(pse=torch.randn(2, 2, 20, 24), pse_type=0, actual_seq_qlen=[10, 30],
                            actual_seq_kvlen=[12, 36]), keep_prob=0.9),
        FACase("python TND softmax_layout TND", "python", "TND", _tnd(30, 4, 16), _tnd(36, 2, 16), _tnd(36, 2, 16), 4,
               opts=dict(atten_mask=CAUSAL_2048, sparse_mode=3, actual_seq_qlen=[10, 30], actual_seq_kvlen=[12, 36],
                         softmax_layout="TND")),
    ]


def _prefix_dense(b, sq, skv, prefix):
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(skv).view(1, -1)
    keep = torch.stack([(j <= i + skv - sq) | (j < p) for p in prefix])
    return (~keep).unsqueeze(1)


def _rows_masked(sq, skv, rows):
    m = torch.zeros(sq, skv, dtype=torch.bool)
    m[rows] = True
    return m


_OPERATOR = {"score": "flash_attention_score(+_grad)", "varlen": "flash_attention_var_len_score / unpadding_grad",
             "varlen_v2": "flash_attention_var_len_score_v2 / unpadding_grad_v2", "python": "attnops.flash_attention"}


def _backends(case: FACase) -> tuple[str, ...]:
    """The reference, plus Triton when its kernels serve the case: head dims up to 256, and bf16 on CUDA only
    (Triton's CPU interpreter has no bf16; docs/triton.md)."""
    d, dv = case.q_shape[-1], case.v_shape[-1]
    if case.layout in ("BSH", "SBH"):
        d //= case.head_num
        dv //= case.k_shape[-1] // d
    if max(d, dv) > TRITON_MAX_HEAD_DIM or (case.dtype == torch.bfloat16 and not triton_runs_on_cuda()):
        return ("reference",)
    return ("reference", "triton")


def cases() -> list[CheckCase]:
    return [CheckCase(_OPERATOR[c.api], c.name, (lambda backend, c=c: _run(c, backend)), _backends(c))
            for c in fa_cases()]
