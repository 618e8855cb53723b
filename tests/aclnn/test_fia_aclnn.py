"""aclnnFusedInferAttentionScoreV2 under its aclnn name: the seed's parameter order, the two-phase calling
convention (get_workspace_size -> executor, run once), the outputs' dtypes/shapes and softmax_lse_flag, and
values vs the fp64 golden through both call forms."""
from __future__ import annotations

import inspect

import pytest
import torch

import attnops
from attnops import AclnnError, ParamInvalidError, aclnn
from attnops.aclnn import AclnnExecutor
from attnops.testing.golden_fia import encode_deq_scale
from tests.ops.fused_infer_attention.fia_helpers import (SEED_ORDER, TRIU2048, aclnn_args, check_fia, make_inputs,
                                                         rand_mask, randint8, to_paged)
from tests.helpers import randn

F16, BF16 = torch.float16, torch.bfloat16


def test_fia_is_exported():
    assert "fused_infer_attention_score_v2" in aclnn.__all__
    assert "fused_infer_attention_score_v2_get_workspace_size" in aclnn.__all__


def test_fia_seed_parameter_order():
    phase1 = aclnn.fused_infer_attention_score_v2_get_workspace_size
    assert list(inspect.signature(phase1).parameters) == SEED_ORDER
    assert list(inspect.signature(aclnn.fused_infer_attention_score_v2).parameters) in (SEED_ORDER,
                                                                                       ["args", "kwargs"])


def test_fia_keyword_call_matches_positional():
    q, k, v = make_inputs("BSH", dtype=F16)
    pos = aclnn.fused_infer_attention_score_v2(*aclnn_args(q, k, v, num_heads=2, scale_value=0.25))
    kw = dict(zip(SEED_ORDER, aclnn_args(q, k, v, num_heads=2, scale_value=0.25)))
    named = aclnn.fused_infer_attention_score_v2(**kw)
    assert torch.equal(pos[0], named[0])


# ------------------------------------------------------------------------------------------- two-phase form
def test_fia_two_phase_runs_once():
    q, k, v = make_inputs("BSH", dtype=F16)
    ws, ex = aclnn.fused_infer_attention_score_v2_get_workspace_size(*aclnn_args(q, k, v, num_heads=2))
    assert isinstance(ws, int) and ws >= 0 and isinstance(ex, AclnnExecutor)
    out, lse = aclnn.fused_infer_attention_score_v2(None, ws, ex, None)
    direct, _ = aclnn.fused_infer_attention_score_v2(*aclnn_args(q, k, v, num_heads=2))
    assert torch.equal(out, direct)
    with pytest.raises(AclnnError) as info:
        aclnn.fused_infer_attention_score_v2(None, ws, ex, None)
    assert info.value.status == 161002 and str(info.value).startswith("executor")


def test_fia_phase_1_validates_before_running():
    q, k, v = make_inputs("BSH", dtype=F16)
    with pytest.raises(ParamInvalidError):
        aclnn.fused_infer_attention_score_v2_get_workspace_size(*aclnn_args(q, k, v, num_heads=2, sparse_mode=9,
                                                                           atten_mask=TRIU2048))


def test_fia_phase_2_uses_inputs_captured_in_phase_1():
    q, k, v = make_inputs("BSH", dtype=F16)
    args = aclnn_args(q, k, v, num_heads=2, softmax_lse_flag=True)
    expected = aclnn.fused_infer_attention_score_v2(*args)
    ws, ex = aclnn.fused_infer_attention_score_v2_get_workspace_size(*args)
    out, lse = aclnn.fused_infer_attention_score_v2(None, ws, ex, None)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])


@pytest.mark.parametrize("via", ["aclnn", "two_phase"])
@pytest.mark.parametrize("case", ["prefill-mask", "decode-paged", "int8-chain", "antiquant", "prefix-leftpad"])
def test_fia_values_both_call_forms(via, case):
    if case == "prefill-mask":
        q, k, v = make_inputs("BNSD", b=2, n=4, nkv=2, sq=6, skv=9, d=16, dtype=BF16)
        check_fia(q, k, v, via=via, atten_mask=rand_mask(2, 1, 6, 9, seed=1), sparse_mode=1, num_heads=4,
                  num_key_value_heads=2, scale_value=0.25, input_layout="BNSD", softmax_lse_flag=True)
    elif case == "decode-paged":
        q = randn(2, 2, 1, 16, dtype=F16)
        k, v = randn(2, 2, 40, 16, dtype=F16, seed=1), randn(2, 2, 40, 16, dtype=F16, seed=2)
        kc, bt = to_paged(k, [40, 17], 16, cache_layout="BNSD")
        vc, _ = to_paged(v, [40, 17], 16, cache_layout="BNSD")
        check_fia(q, kc, vc, via=via, block_table=bt, block_size=16, actual_seq_lengths_kv=[40, 17], num_heads=2,
                  scale_value=0.25, input_layout="BNSD", softmax_lse_flag=True)
    elif case == "int8-chain":
        q, k, v = (randint8(2, s, 64, seed=i) for i, s in enumerate((5, 7, 7)))
        check_fia(q, k, v, via=via, deq_scale1=encode_deq_scale(8e-5), quant_scale1=torch.tensor([127.0]),
                  deq_scale2=encode_deq_scale(1 / 127), quant_scale2=torch.tensor([0.5]), num_heads=2,
                  scale_value=0.7, input_layout="BSH", softmax_lse_flag=True)
    elif case == "antiquant":
        q = randn(2, 1, 64, dtype=F16)
        check_fia(q, randint8(2, 9, 64, seed=1), randint8(2, 9, 64, seed=2), via=via,
                  antiquant_scale=torch.full((2, 64), 0.01, dtype=F16), num_heads=2, scale_value=0.25,
                  input_layout="BSH", softmax_lse_flag=True)
    else:
        q, k, v = make_inputs("BSH", b=2, n=2, sq=1, skv=8, d=16, dtype=F16)
        check_fia(q, k, v, via=via, actual_seq_lengths_kv=[3, 6], kv_padding_size=torch.tensor([1]), num_heads=2,
                  scale_value=0.25, input_layout="BSH", softmax_lse_flag=True)
        kp, vp, _ = make_inputs("BSH", b=1, n=2, sq=3, skv=3, d=16, dtype=F16, seed=3)
        check_fia(q, k, v, via=via, key_shared_prefix=kp, value_shared_prefix=vp, num_heads=2, scale_value=0.25,
                  input_layout="BSH", softmax_lse_flag=True)


# ------------------------------------------------------------------------------------------- outputs
@pytest.mark.parametrize("sq", [1, 4])
def test_fia_lse_flag_false_returns_zeros_1(sq):
    """Seed: softmaxLseFlag False and a null softmaxLse -> a {1}-shaped zero tensor."""
    q, k, v = make_inputs("BSH", sq=sq, dtype=F16)
    out, lse = aclnn.fused_infer_attention_score_v2(*aclnn_args(q, k, v, num_heads=2))
    assert lse.shape == (1,) and lse.dtype == torch.float32 and float(lse[0]) == 0.0


@pytest.mark.parametrize("layout,sq,shape", [("BSH", 4, (2, 2, 4, 1)), ("BNSD_BSND", 4, (2, 2, 4, 1)),
                                             ("BNSD", 1, (2, 2, 1, 1))])
def test_fia_lse_shape(layout, sq, shape):
    q, k, v = make_inputs(layout, sq=sq, dtype=F16)
    out, lse = aclnn.fused_infer_attention_score_v2(*aclnn_args(q, k, v, num_heads=2, input_layout=layout,
                                                                softmax_lse_flag=True))
    assert lse.shape == shape and lse.dtype == torch.float32


def test_fia_bnsd_bsnd_output_layout():
    q, k, v = make_inputs("BNSD", b=2, n=2, sq=4, skv=6, dtype=F16)
    out, _ = aclnn.fused_infer_attention_score_v2(*aclnn_args(q, k, v, num_heads=2, input_layout="BNSD_BSND"))
    ref, _ = aclnn.fused_infer_attention_score_v2(*aclnn_args(q, k, v, num_heads=2, input_layout="BNSD"))
    assert out.shape == (2, 4, 2, 16)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=0, atol=0)


@pytest.mark.parametrize("qdtype,kw,out_dtype", [
    (F16, {}, F16), (BF16, {}, BF16), (F16, dict(quant_scale2=torch.tensor([1.0])), torch.int8),
    (torch.int8, dict(deq_scale1=torch.tensor([1e-4]), quant_scale1=torch.tensor([127.0]),
                      deq_scale2=torch.tensor([1e-2])), F16)])
def test_fia_output_dtype(qdtype, kw, out_dtype):
    if qdtype == torch.int8:
        q, k, v = (randint8(2, s, 64, seed=i) for i, s in enumerate((4, 6, 6)))
    else:
        q, k, v = make_inputs("BSH", b=2, n=2, sq=4, skv=6, d=32, dtype=qdtype)
    out, _ = aclnn.fused_infer_attention_score_v2(*aclnn_args(q, k, v, num_heads=2, **kw))
    assert out.dtype == out_dtype and out.shape == q.shape


def test_fia_empty_query_returns_empty():
    q, k, v = make_inputs("BSH", sq=4, dtype=F16)
    q = q[:, :0].contiguous()
    out, _ = aclnn.fused_infer_attention_score_v2(*aclnn_args(q, k, v, num_heads=2))
    assert out.shape == q.shape


def test_fia_does_not_modify_inputs():
    q, k, v = make_inputs("BSH", sq=4, dtype=F16)
    m = rand_mask(2, 4, 7, seed=1)
    copies = [t.clone() for t in (q, k, v, m)]
    aclnn.fused_infer_attention_score_v2(*aclnn_args(q, k, v, atten_mask=m, sparse_mode=1, num_heads=2))
    for a, b in zip((q, k, v, m), copies):
        assert torch.equal(a, b)


def test_fia_errors_are_aclnn_errors():
    q, k, v = make_inputs("BSH", dtype=F16)
    with pytest.raises(AclnnError):
        aclnn.fused_infer_attention_score_v2(*aclnn_args(q, k, v, num_heads=2, input_layout="XYZ"))
    assert issubclass(attnops.ParamInvalidError, ValueError)
