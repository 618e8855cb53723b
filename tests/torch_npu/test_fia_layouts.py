"""npu_fused_infer_attention_score's torch_npu-only layouts (torch_npu_api.md §4.2; op-plugin's meta functions
shape them): NTD, NSD and the X_Y forms writing BNSD, NBSD, TND or NTD, against the FIA golden in the layout the
data is read in."""
from __future__ import annotations

import pytest
import torch

from attnops import torch_npu
from attnops.testing import golden_fia
from attnops.testing.compare import assert_close_to_golden, fia_reduction
from tests.helpers import TRIU2048, cum, randn

F16 = torch.float16
B, N, NKV, SQ, SKV, D = 2, 4, 2, 5, 9, 16


def _bsnd(n, s, seed):
    return randn(B, s, n, D, dtype=F16, seed=seed)


def _as(x, layout):
    """A [B, S, N, D] tensor in ``layout`` (BSH, BSND, BNSD)."""
    return {"BSH": x.flatten(-2), "BSND": x, "BNSD": x.transpose(1, 2).contiguous()}[layout]


def _golden(q, k, v, **kw):
    return [golden_fia.fia_forward(q, k, v, dtype=dt, softmax_lse_flag=True, **kw) for dt in (torch.float64, F16)]


@pytest.mark.parametrize("layout", ["BSH_BNSD", "BSND_BNSD", "BSH_NBSD", "BSND_NBSD", "BNSD_NBSD"])
def test_output_layout_forms(layout):
    reads, writes = layout.split("_")
    q, k, v = (_as(x, reads) for x in (_bsnd(N, SQ, 1), _bsnd(NKV, SKV, 2), _bsnd(NKV, SKV, 3)))
    kw = dict(num_heads=N, num_key_value_heads=NKV, actual_seq_lengths=[5, 3], actual_seq_lengths_kv=[9, 6],
              atten_mask=TRIU2048, sparse_mode=3)
    out, lse = torch_npu.npu_fused_infer_attention_score(q, k, v, scale=0.25, input_layout=layout,
                                                         softmax_lse_flag=True, **kw)
    (g, g_lse), (b, b_lse) = _golden(q, k, v, scale_value=0.25, input_layout=reads, **kw)
    red = fia_reduction(q, k, input_layout=reads, **kw)
    to_bsnd = (lambda x: x.unflatten(-1, (N, -1))) if reads == "BSH" else (
        (lambda x: x.transpose(1, 2)) if reads == "BNSD" else (lambda x: x))
    order = (0, 2, 1, 3) if writes == "BNSD" else (2, 0, 1, 3)
    g, b = (to_bsnd(x).permute(order) for x in (g, b))
    assert out.shape == g.shape and lse.shape == (B, N, SQ, 1)
    assert_close_to_golden("attention_out", out, g, b, reduction=red)
    assert_close_to_golden("softmax_lse", lse, g_lse, b_lse, reduction=red)


@pytest.mark.parametrize("layout", ["NTD", "NTD_TND", "TND_NTD"])
def test_ntd_forms(layout):
    lens, kv_lens = [5, 3], [9, 6]
    t, tk = sum(lens), sum(kv_lens)
    q, k, v = randn(t, N, D, dtype=F16, seed=4), randn(tk, NKV, D, dtype=F16, seed=5), randn(tk, NKV, D, dtype=F16,
                                                                                              seed=6)
    reads = "NTD" if layout.startswith("NTD") else "TND"
    args = [x.transpose(0, 1).contiguous() if reads == "NTD" else x for x in (q, k, v)]
    kw = dict(num_heads=N, num_key_value_heads=NKV, actual_seq_lengths=cum(lens), actual_seq_lengths_kv=cum(kv_lens),
              atten_mask=TRIU2048, sparse_mode=3)
    out, lse = torch_npu.npu_fused_infer_attention_score(*args, scale=0.25, input_layout=layout,
                                                         softmax_lse_flag=True, **kw)
    (g, g_lse), (b, b_lse) = _golden(q, k, v, scale_value=0.25, input_layout="TND", **kw)
    red = fia_reduction(q, k, input_layout="TND", **kw)
    if layout.endswith("NTD"):
        g, b = g.transpose(0, 1), b.transpose(0, 1)
    assert out.shape == g.shape and lse.shape == (t, N, 1)
    assert_close_to_golden("attention_out", out, g, b, reduction=red)
    assert_close_to_golden("softmax_lse", lse, g_lse, b_lse, reduction=red)


def test_nsd_is_one_batch_of_bnsd_also_paged():
    q, k, v = randn(N, SQ, D, dtype=F16, seed=7), randn(NKV, SKV, D, dtype=F16, seed=8), randn(NKV, SKV, D,
                                                                                                dtype=F16, seed=9)
    kw = dict(num_heads=N, num_key_value_heads=NKV, atten_mask=TRIU2048, sparse_mode=3)
    out, lse = torch_npu.npu_fused_infer_attention_score(q, k, v, scale=0.25, input_layout="NSD",
                                                         softmax_lse_flag=True, **kw)
    (g, g_lse), (b, b_lse) = _golden(q[None], k[None], v[None], scale_value=0.25, input_layout="BNSD", **kw)
    red = fia_reduction(q[None], k[None], input_layout="BNSD", **kw)
    assert out.shape == (N, SQ, D) and lse.shape == (1, N, SQ, 1)
    assert_close_to_golden("attention_out", out, g[0], b[0], reduction=red)
    assert_close_to_golden("softmax_lse", lse, g_lse, b_lse, reduction=red)
    # the same keys in a (blocknum, KV_N, blocksize, D) cache: the cache keeps its own layout
    cache_k = torch.zeros(4, NKV, 4, D, dtype=F16)
    cache_v = torch.zeros_like(cache_k)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    for p in range(SKV):
        cache_k[table[0, p // 4], :, p % 4], cache_v[table[0, p // 4], :, p % 4] = k[:, p], v[:, p]
    paged, paged_lse = torch_npu.npu_fused_infer_attention_score(
        q, cache_k, cache_v, scale=0.25, input_layout="NSD", softmax_lse_flag=True, block_table=table, block_size=4,
        actual_seq_lengths_kv=[SKV], **kw)
    assert_close_to_golden("attention_out(paged)", paged, g[0], b[0], reduction=red)


def test_v2_sink_with_an_nbsd_output():
    q, k, v = (_as(x, "BSND") for x in (_bsnd(N, SQ, 10), _bsnd(NKV, SKV, 11), _bsnd(NKV, SKV, 12)))
    sink = torch.tensor([0.5, -1.0, 0.0, 2.0])
    kw = dict(num_query_heads=N, num_key_value_heads=NKV, softmax_scale=0.25, return_softmax_lse=True,
              learnable_sink=sink)
    out, lse = torch_npu.npu_fused_infer_attention_score_v2(q, k, v, input_layout="BSND_NBSD", **kw)
    ref, ref_lse = torch_npu.npu_fused_infer_attention_score_v2(q, k, v, input_layout="BSND", **kw)
    assert torch.equal(out, ref.permute(2, 0, 1, 3)) and torch.equal(lse, ref_lse)
