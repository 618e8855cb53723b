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


# ------------------------------------------------------------ the aclnn and torch_npu dialects: the same check
def _aclnn_fa(scale):
    from attnops import aclnn
    q, k, v = torch.randn(1, 3, 16), torch.randn(1, 5, 16), torch.randn(1, 5, 16)
    return aclnn.flash_attention_score(q, k, v, None, None, None, None, None, scale, 1.0, 65536, 65536, 2, "BSH", 0, 0)


def _npu_fa(scale):
    from attnops import torch_npu
    q, k, v = torch.randn(1, 3, 16), torch.randn(1, 5, 16), torch.randn(1, 5, 16)
    return torch_npu.npu_fusion_attention(q, k, v, 2, "BSH", scale=scale)


def _npu_fia(scale):
    from attnops import torch_npu
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    return torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=2, input_layout="BNSD", scale=scale)


def _npu_nsa_selected(scale):
    from attnops import torch_npu
    q, k, v = torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    topk = torch.zeros(4, 1, 1, dtype=torch.int32)
    return torch_npu.npu_nsa_select_attention(q, k, v, topk, scale, 2, 4, 1, actual_seq_qlen=[4],
                                              actual_seq_kvlen=[4])


@pytest.mark.parametrize("call,name", [(_aclnn_fa, "scale_value"), (_npu_fa, "scale"), (_npu_fia, "scale"),
                                       (_npu_nsa_selected, "scale_value")])
@pytest.mark.parametrize("scale,error", BAD)
def test_bad_scale_raises_in_the_dialects(call, name, scale, error):
    call(0.5)  # the same call with a valid scale runs
    with pytest.raises(error, match=rf"(^|\b){name}: expected a finite float"):
        call(scale)
