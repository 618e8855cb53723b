"""The one ``scale`` check (``attnops._core.checks.softmax_scale``) on every Pythonic operator family: NaN/Inf,
strings and bools raise a clear attnops error instead of NaN outputs or a ``float('0.1')`` accepted by luck."""
import pytest
import torch

import attnops
from attnops._core.errors import ParamDtypeError, ParamInvalidError

BAD = [("0.1", ParamDtypeError), (True, ParamDtypeError), (float("nan"), ParamInvalidError),
       (float("inf"), ParamInvalidError)]


def _fia(scale):
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    return attnops.fused_infer_attention(q, k, v, layout="BNSD", num_heads=2, scale=scale)


def _nsa_selected(scale):
    q, k, v = torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    topk = torch.zeros(4, 1, 1, dtype=torch.int32)
    return attnops.nsa_selected_attention(q, k, v, topk, select_block_size=4, actual_seq_qlen=[4],
                                          actual_seq_kvlen=[4], scale=scale)


@pytest.mark.parametrize("call", [_fia, _nsa_selected])
@pytest.mark.parametrize("scale,error", BAD)
def test_bad_scale_raises(call, scale, error):
    call(0.5)  # the same call with a valid scale runs
    with pytest.raises(error, match="scale: expected a finite float"):
        call(scale)


def test_zero_head_dim_raises_in_fia():
    q = k = v = torch.zeros(1, 2, 3, 0)
    with pytest.raises(ParamInvalidError, match="head dim D >= 1"):
        attnops.fused_infer_attention(q, k, v, layout="BNSD", num_heads=2)
