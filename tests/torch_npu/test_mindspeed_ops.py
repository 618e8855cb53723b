"""MindSpeed's op-builder ops (positional signatures) on attnops through :mod:`attnops.torch_npu.mindspeed_ops`,
driven the way MindSpeed's autograd wrapper drives them, against the fp64 golden."""
from __future__ import annotations

import torch

from attnops.testing.compare import assert_close_to_golden, fa_reductions
from attnops.testing.golden import fa_backward, fa_forward
from attnops.torch_npu.mindspeed_ops import OPS
from tests.helpers import TRIU2048, randn

INT_MAX = 2147483647


class BuilderFlashAttention(torch.autograd.Function):
    """The op-builder pattern: the loaded extension's forward keeps its outputs; backward calls its grad."""

    @staticmethod
    def forward(ctx, q, k, v, head_num, layout, mask, scale, qlen, kvlen, sparse_mode):
        out, smax, ssum, sin, seed, offset, numels = OPS.npu_fusion_attention_v2(
            q, k, v, head_num, layout, None, None, mask, scale, 1.0, INT_MAX, INT_MAX, 0, None, qlen, kvlen,
            sparse_mode, True, False, 1, None, None)
        ctx.save_for_backward(q, k, v, mask, out, smax, ssum)
        ctx.cfg = (head_num, layout, scale, seed, offset, numels, qlen, kvlen, sparse_mode)
        return out

    @staticmethod
    def backward(ctx, dy):
        q, k, v, mask, out, smax, ssum = ctx.saved_tensors
        head_num, layout, scale, seed, offset, numels, qlen, kvlen, sparse_mode = ctx.cfg
        dq, dk, dv, _ = OPS.npu_fusion_attention_grad_v2(
            q, k, v, dy, head_num, layout, None, None, mask, smax, ssum, None, out, scale, 1.0, INT_MAX, INT_MAX, 0,
            seed, offset, numels, None, qlen, kvlen, sparse_mode, True, False, 1, None, None)
        return dq, dk, dv, *([None] * 7)


def test_fusion_attention_v2_builder_ops_match_golden():
    q, k, v = (randn(40, 4, 16, seed=i).requires_grad_() for i in range(3))
    dy = randn(40, 4, 16, seed=3)
    out = BuilderFlashAttention.apply(q, k, v, 4, "TND", TRIU2048, 0.25, [15, 40], [15, 40], 3)
    out.backward(dy)
    kw = dict(head_num=4, input_layout="TND", atten_mask=TRIU2048, sparse_mode=3, scale=0.25,
              actual_seq_qlen=[15, 40], actual_seq_kvlen=[15, 40])
    red = fa_reductions(q, k, v, layout="TND", head_num=4, actual_seq_qlen=[15, 40], actual_seq_kvlen=[15, 40])
    assert_close_to_golden("out", out, fa_forward(q, k, v, **kw)[0], fa_forward(q, k, v, dtype=q.dtype, **kw)[0],
                           reduction=red["out"])
    gold, base = fa_backward(dy, q, k, v, **kw), fa_backward(dy, q, k, v, dtype=q.dtype, **kw)
    for name, actual, g, b in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), gold, base):
        assert_close_to_golden(name, actual, g, b, factor=3.0, reduction=red[name])


def test_ring_attention_update_builder_op_merges_two_kv_halves():
    s, b, n, d = 12, 2, 4, 16
    q, k, v = randn(s, b, n * d, seed=10), randn(2 * s, b, n * d, seed=11), randn(2 * s, b, n * d, seed=12)
    halves = [OPS.npu_fusion_attention_v2(q, k[part], v[part], n, "SBH", None, None, None, 0.25, 1.0, INT_MAX,
                                          INT_MAX, 0, None, None, None, 0, True, False, 1, None, None)[:3]
              for part in (slice(0, s), slice(s, 2 * s))]
    out, smax, ssum = OPS.npu_ring_attention_update(*halves[0], *halves[1], None, "SBH")
    kw = dict(head_num=n, input_layout="SBH", scale=0.25)
    gold, base = fa_forward(q, k, v, **kw), fa_forward(q, k, v, dtype=q.dtype, **kw)
    red = fa_reductions(q, k, v, layout="SBH", head_num=n)
    for name, actual, g, bl in zip(("out", "softmax_max", "softmax_sum"), (out, smax, ssum), gold, base):
        assert_close_to_golden(name, actual, g, bl, reduction=red[name])
