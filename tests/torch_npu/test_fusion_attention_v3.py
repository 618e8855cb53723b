"""npu_fusion_attention_v3 / npu_fusion_attention_grad_v3 (torch_npu_api.md §3.2; signatures as op-plugin's fake
kernels): v1's arguments, seed/offset as int64 [1] tensors, no numels, tensor sequence lengths."""
from __future__ import annotations

import inspect

import pytest
import torch

from attnops import torch_npu
from attnops.testing.compare import assert_close_to_golden, fa_reductions
from attnops.testing.golden import fa_backward, fa_forward
from tests.helpers import TRIU2048, cum, randn

F16 = torch.float16


def test_v3_signatures_as_op_plugin_fake_kernels():
    fwd = inspect.signature(torch_npu.npu_fusion_attention_v3).parameters
    assert list(fwd)[:8] == ["query", "key", "value", "head_num", "input_layout", "pse", "padding_mask", "atten_mask"]
    assert list(fwd)[-4:] == ["gen_mask_parallel", "sync", "softmax_layout", "sink"]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in fwd.values())
    bwd = inspect.signature(torch_npu.npu_fusion_attention_grad_v3).parameters
    assert "numels" not in bwd and bwd["seed"].default is None and bwd["seed"].kind is inspect.Parameter.KEYWORD_ONLY


def test_v3_tnd_with_tensor_lengths_matches_golden_and_v1():
    lens = [7, 20, 13]
    t = sum(lens)
    q, k, v, dy = (randn(t, 4, 16, dtype=F16, seed=i) for i in range(4))
    qlen = torch.tensor(cum(lens), dtype=torch.int64)
    kw = dict(atten_mask=TRIU2048, sparse_mode=3)
    out, smax, ssum, softmax_out, seed, offset = torch_npu.npu_fusion_attention_v3(
        q, k, v, 4, "TND", scale=0.25, actual_seq_qlen=qlen, actual_seq_kvlen=qlen, **kw)
    assert seed.dtype == offset.dtype == torch.int64 and seed.shape == offset.shape == (1,)
    assert softmax_out.shape == (0,) and smax.shape == (t, 4, 8)
    v1 = torch_npu.npu_fusion_attention(q, k, v, 4, "TND", scale=0.25, actual_seq_qlen=cum(lens),
                                        actual_seq_kvlen=cum(lens), **kw)
    assert torch.equal(out, v1[0]) and torch.equal(smax, v1[1]) and torch.equal(ssum, v1[2])
    gkw = dict(head_num=4, input_layout="TND", scale=0.25, actual_seq_qlen=cum(lens), actual_seq_kvlen=cum(lens),
               **kw)
    red = fa_reductions(q, k, v, layout="TND", head_num=4, actual_seq_qlen=cum(lens), actual_seq_kvlen=cum(lens))
    assert_close_to_golden("attention_out", out, fa_forward(q, k, v, **gkw)[0],
                           fa_forward(q, k, v, dtype=F16, **gkw)[0], reduction=red["out"])
    dq, dk, dv, dpse, dsink = torch_npu.npu_fusion_attention_grad_v3(
        q, k, v, dy, 4, "TND", softmax_max=smax, softmax_sum=ssum, attention_in=out, scale_value=0.25, seed=seed,
        offset=offset, actual_seq_qlen=qlen, actual_seq_kvlen=qlen, **kw)
    assert dpse.shape == (0,) and dsink.shape == ()
    golden, base = fa_backward(dy, q, k, v, **gkw), fa_backward(dy, q, k, v, dtype=F16, **gkw)
    for name, got, g, b in zip(("dq", "dk", "dv"), (dq, dk, dv), golden, base):
        assert_close_to_golden(name, got, g, b, factor=3.0, reduction=red[name])


def test_v3_dropout_seed_tensors_regenerate_the_mask():
    q, k, v, dy = (randn(1, 2, 32, 16, seed=10 + i) for i in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, smax, ssum, _, seed, offset = torch_npu.npu_fusion_attention_v3(*leaves, 2, "BNSD", scale=0.25,
                                                                         keep_prob=0.7)
    out.backward(dy)  # autograd regenerates the mask from the drawn seed
    grads = torch_npu.npu_fusion_attention_grad_v3(q, k, v, dy, 2, "BNSD", softmax_max=smax, softmax_sum=ssum,
                                                   attention_in=out.detach(), scale_value=0.25, keep_prob=0.7,
                                                   seed=seed, offset=offset)
    for leaf, g in zip(leaves, grads[:3]):
        assert torch.equal(leaf.grad, g)
    with pytest.raises(ValueError, match="seed"):
        torch_npu.npu_fusion_attention_grad_v3(q, k, v, dy, 2, "BNSD", softmax_max=smax, softmax_sum=ssum,
                                               attention_in=out.detach(), scale_value=0.25, keep_prob=0.7)
    with pytest.raises(ValueError, match="offset"):
        torch_npu.npu_fusion_attention_grad_v3(q, k, v, dy, 2, "BNSD", softmax_max=smax, softmax_sum=ssum,
                                               attention_in=out.detach(), scale_value=0.25, keep_prob=0.7,
                                               seed=seed, offset=torch.zeros(2, dtype=torch.int64))
