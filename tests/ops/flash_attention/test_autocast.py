"""Under ``torch.autocast`` the Pythonic FlashAttention computes in the autocast dtype, as SDPA does (inputs of
mixed float dtypes are cast instead of raising), forward and backward."""
import pytest
import torch

import attnops
from attnops.testing.compare import assert_close_to_golden, fa_reductions
from attnops.testing.golden import fa_forward
from tests.helpers import F64, make_qkv, randn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_casts_mixed_inputs_like_sdpa(dtype):
    q, k, v, dy = make_qkv("BNSD", b=1, n1=2, sq=6, skv=6, seed=4)
    q = q.to(dtype)  # a low-precision query with fp32 keys/values
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=dtype):
        out = attnops.flash_attention(*leaves, causal=True, scale=0.4)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.4)
    assert out.dtype == sdpa.dtype == dtype
    kw = dict(head_num=2, input_layout="BNSD", scale=0.4, atten_mask=torch.ones(6, 6, dtype=torch.bool).triu(1))
    lowp = [t.to(dtype) for t in (q, k, v)]
    assert_close_to_golden("out", out, fa_forward(*lowp, dtype=F64, **kw)[0], fa_forward(*lowp, dtype=dtype, **kw)[0],
                           reduction=fa_reductions(*lowp, layout="BNSD", head_num=2)["out"])
    out.backward(dy.to(dtype))
    assert [t.grad.dtype for t in leaves] == [dtype, torch.float32, torch.float32]  # grads follow the leaves


def test_autocast_backward_function_and_pse():
    q, k, v, dy = make_qkv("BNSD", b=1, n1=2, sq=5, skv=5, seed=6)
    pse = randn(1, 2, 5, 5, seed=7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res = attnops.flash_attention(q, k, v, pse=pse, pse_type=1, return_stats=True)
        dq, dk, dv, dpse = attnops.flash_attention_backward(dy, q, k, v, res.out, res.softmax_max, res.softmax_sum,
                                                            pse=pse, pse_type=1)
    assert res.out.dtype == dq.dtype == dk.dtype == dv.dtype == dpse.dtype == torch.bfloat16


def test_without_autocast_mixed_dtypes_still_raise():
    q, k, v, _ = make_qkv("BNSD", b=1, n1=1, sq=4, seed=1)
    with pytest.raises(Exception, match="key: expected dtype torch.bfloat16"):
        attnops.flash_attention(q.bfloat16(), k, v)
