"""Paged caches in flash-attn/vLLM's ``[num_blocks, page, N_kv, D]`` layout: the Pythonic and torch_npu APIs read
them as their ``(blocknum, blocksize, H)`` view (no copy) and agree with the fp64 golden of that cache; the aclnn
dialect keeps CANN's layouts; a cache of no accepted shape gets one message naming the accepted forms."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops import torch_npu
from attnops.ops.fused_infer_attention.paged import flash_attn_cache_views
from attnops.testing.compare import assert_close_to_golden, fia_reduction
from tests.helpers import randn
from tests.ops.fused_infer_attention.fia_helpers import baseline_dtype, golden, make_inputs, run_aclnn, to_paged

F16 = torch.float16
N, NKV, D, BS, LENS = 4, 2, 16, 16, [40, 7]


def _call(layout, sq):
    q, _, _ = make_inputs(layout, b=2, n=N, nkv=NKV, sq=sq, skv=1, d=D, dtype=F16, seed=1)
    kc, table = to_paged(randn(2, NKV, max(LENS), D, dtype=F16, seed=2), LENS, BS, seed=4)  # (blocknum, bs, H)
    vc, _ = to_paged(randn(2, NKV, max(LENS), D, dtype=F16, seed=3), LENS, BS, seed=4)
    return q, kc, vc, table


@pytest.mark.parametrize("layout,sq", [("BSND", 1), ("BSND", 3), ("BNSD", 1), ("BSH", 1)])
def test_flash_attn_paged_cache_equals_the_golden(layout, sq):
    q, kc, vc, table = _call(layout, sq)
    kw = dict(block_table=table, block_size=BS, actual_seq_lengths_kv=LENS, num_heads=N, num_key_value_heads=NKV,
              scale_value=D ** -0.5, input_layout=layout)
    want, base = golden(q, kc, vc, **kw), golden(q, kc, vc, dtype=baseline_dtype(q), **kw)
    vllm_k, vllm_v = kc.unflatten(-1, (NKV, D)), vc.unflatten(-1, (NKV, D))  # [num_blocks, page, N_kv, D]
    out = attnops.fused_infer_attention(q, vllm_k, vllm_v, layout=layout, num_heads=N, num_key_value_heads=NKV,
                                        block_table=table, actual_seq_lengths_kv=LENS)
    assert_close_to_golden("attention_out", out, want.out, base.out, reduction=fia_reduction(q, kc, **kw))
    npu_out, _ = torch_npu.npu_fused_infer_attention_score(q, vllm_k, vllm_v, block_table=table, block_size=BS,
                                                           actual_seq_lengths_kv=LENS, num_heads=N,
                                                           num_key_value_heads=NKV, scale=D ** -0.5,
                                                           input_layout=layout)
    assert torch.equal(npu_out, out)


def test_flash_attn_paged_cache_is_read_as_a_view():
    _, kc, vc, table = _call("BSND", 1)
    vllm_k, vllm_v = kc.unflatten(-1, (NKV, D)), vc.unflatten(-1, (NKV, D))
    options = dict(block_table=table, num_heads=N, num_key_value_heads=NKV, input_layout="BSND")
    key, value = flash_attn_cache_views(vllm_k, vllm_v, options)
    assert key.shape == kc.shape and key.data_ptr() == kc.data_ptr() and value.data_ptr() == vc.data_ptr()
    cann = kc.unflatten(-1, (NKV, D)).transpose(1, 2)  # (blocknum, KV_N, blocksize, D) with a BNSD query: CANN's
    assert flash_attn_cache_views(cann, cann, dict(options, input_layout="BNSD"))[0] is cann
    assert flash_attn_cache_views(vllm_k, vllm_v, dict(options, strict=True))[0] is vllm_k


def test_a_cache_of_no_accepted_shape_names_the_accepted_forms():
    q, kc, vc, table = _call("BSND", 1)
    bad = kc.unflatten(-1, (NKV, D))[..., :8]
    with pytest.raises(ValueError, match=r"key: expected a paged cache \(blocknum, blocksize, H=2\*16\), NZ .*"
                                         r"or flash-attn/vLLM's \(blocknum, blocksize, KV_N=2, D=16\), got .*"
                                         r"\.flatten\(2\)"):
        attnops.fused_infer_attention(q, bad, bad, layout="BSND", num_key_value_heads=NKV, block_table=table,
                                      actual_seq_lengths_kv=LENS)
    vllm = kc.unflatten(-1, (NKV, D))
    with pytest.raises(ValueError, match=r"key: expected a paged cache .*BNSD/TND query.*\(blocknum, KV_N=2, "
                                         r"blocksize, D=16\), got .*\.flatten\(2\)"):  # aclnn: CANN's layouts only
        run_aclnn(q, vllm, vc.unflatten(-1, (NKV, D)), block_table=table, block_size=BS, actual_seq_lengths_kv=LENS,
                  num_heads=N, num_key_value_heads=NKV, input_layout="BSND")
