"""Code written the way MindSpeed and vllm-ascend call torch_npu, run on attnops and judged against the fp64
goldens (FlashAttention's tolerance rule: the golden's formula in the input dtype is the baseline)."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops import torch_npu
from attnops.testing import golden_fia, golden_nsa
from attnops.testing.compare import assert_close_to_golden, fa_reductions, fia_reduction
from attnops.testing.golden import fa_backward, fa_forward
from tests.helpers import TRIU2048, cum, randn
from tests.ops.nsa.nsa_helpers import nsa_reductions


class MindSpeedFlashAttention(torch.autograd.Function):
    """MindSpeed's pattern: forward keeps softmax_max/sum, attention_in and the rng triple; backward calls
    npu_fusion_attention_grad with them."""

    @staticmethod
    def forward(ctx, q, k, v, n, layout, mask, scale, keep_prob):
        out, smax, ssum, _, seed, offset, numels = torch_npu.npu_fusion_attention(
            q, k, v, n, layout, pse=None, padding_mask=None, atten_mask=mask, scale=scale, keep_prob=keep_prob,
            pre_tockens=65536, next_tockens=0, inner_precise=0, sparse_mode=2)
        ctx.save_for_backward(q, k, v, mask, out, smax, ssum)
        ctx.cfg = (n, layout, scale, keep_prob, seed, offset, numels)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, out, smax, ssum = ctx.saved_tensors
        n, layout, scale, keep_prob, seed, offset, numels = ctx.cfg
        dq, dk, dv, *_ = torch_npu.npu_fusion_attention_grad(
            q, k, v, dout, n, layout, pse=None, padding_mask=None, atten_mask=mask, softmax_max=smax,
            softmax_sum=ssum, attention_in=out, scale_value=scale, keep_prob=keep_prob, pre_tockens=65536,
            next_tockens=0, seed=seed, offset=offset, numels=numels, sparse_mode=2)
        return dq, dk, dv, None, None, None, None, None


def _sbh(s=12, b=2, n1=4, n2=2, d=16, seed=0):
    return (randn(s, b, n1 * d, seed=seed).requires_grad_(), randn(s, b, n2 * d, seed=seed + 1).requires_grad_(),
            randn(s, b, n2 * d, seed=seed + 2).requires_grad_(), randn(s, b, n1 * d, seed=seed + 3))


def test_mindspeed_autograd_wrapper_matches_golden():
    q, k, v, dy = _sbh()
    scale = 0.25
    out = MindSpeedFlashAttention.apply(q, k, v, 4, "SBH", TRIU2048, scale, 1.0)
    out.backward(dy)
    kw = dict(head_num=4, input_layout="SBH", atten_mask=TRIU2048, sparse_mode=2, scale=scale)
    red = fa_reductions(q, k, v, layout="SBH", head_num=4)
    assert_close_to_golden("out", out, fa_forward(q, k, v, **kw)[0], fa_forward(q, k, v, dtype=q.dtype, **kw)[0],
                           reduction=red["out"])
    gold, base = fa_backward(dy, q, k, v, **kw), fa_backward(dy, q, k, v, dtype=q.dtype, **kw)
    for name, actual, g, bl in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), gold, base):
        assert_close_to_golden(name, actual, g, bl, factor=3.0, reduction=red[name])


def test_dropout_contract_seed_offset_numels_regenerate_the_mask():
    q, k, v, dy = _sbh(seed=10)
    kw = dict(atten_mask=TRIU2048, sparse_mode=2, scale=0.25, keep_prob=0.8)
    out, smax, ssum, _, seed, offset, numels = torch_npu.npu_fusion_attention(q, k, v, 4, "SBH", **kw)
    assert torch_npu.npu_fusion_attention(q, k, v, 4, "SBH", **kw)[4] != seed  # successive calls differ
    assert numels == 2 * 4 * 12 * 12  # B*N*Sq*Skv
    # (seed, offset) determine the mask: the Pythonic API reproduces the output and its autograd the gradients
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = attnops.flash_attention(qq, kk, vv, layout="SBH", head_num=4, seed=seed, offset=offset, **kw)
    ref.backward(dy)
    assert torch.equal(ref, out)
    dq, dk, dv, dpse, dsink = torch_npu.npu_fusion_attention_grad(
        q, k, v, dy, 4, "SBH", atten_mask=TRIU2048, softmax_max=smax, softmax_sum=ssum, attention_in=out,
        scale_value=0.25, keep_prob=0.8, seed=seed, offset=offset, numels=numels, sparse_mode=2)
    assert torch.equal(dq, qq.grad) and torch.equal(dk, kk.grad) and torch.equal(dv, vv.grad)
    assert dpse is None and dsink.shape == (0,) and dsink.dtype == torch.float32
    with pytest.raises(ValueError, match="numels"):
        torch_npu.npu_fusion_attention_grad(
            q, k, v, dy, 4, "SBH", atten_mask=TRIU2048, softmax_max=smax, softmax_sum=ssum, attention_in=out,
            scale_value=0.25, keep_prob=0.8, seed=seed, offset=offset, numels=numels - 1, sparse_mode=2)


def test_ring_merge_of_two_kv_halves_equals_full_attention_sbh():
    q, k, v, _ = _sbh(s=16, seed=20)
    kw = dict(scale=0.25)
    halves = [torch_npu.npu_fusion_attention(q, k[a:b], v[a:b], 4, "SBH", **kw)[:3] for a, b in ((0, 8), (8, 16))]
    out, smax, ssum = torch_npu.npu_ring_attention_update(*halves[0], *halves[1])
    full = torch_npu.npu_fusion_attention(q, k, v, 4, "SBH", **kw)
    gkw = dict(head_num=4, input_layout="SBH", scale=0.25)
    assert_close_to_golden("out", out, fa_forward(q, k, v, **gkw)[0], fa_forward(q, k, v, dtype=q.dtype, **gkw)[0],
                           reduction=fa_reductions(q, k, v, layout="SBH", head_num=4)["out"])
    torch.testing.assert_close(smax, full[1])
    torch.testing.assert_close(ssum, full[2])


def test_ring_tnd_blocked_statistics_forward_and_backward_match_golden():
    lens, heads = [6, 10], 2
    q, k, v, dy = (randn(16, heads, 8, seed=s) for s in (30, 31, 32, 33))
    first = torch.cat([k[0:3], k[6:11]]), torch.cat([v[0:3], v[6:11]])
    second = torch.cat([k[3:6], k[11:16]]), torch.cat([v[3:6], v[11:16]])
    qkw = dict(actual_seq_qlen=cum(lens), actual_seq_kvlen=[3, 8], scale=0.3)
    parts = [torch_npu.npu_fusion_attention(q, kk, vv, heads, "TND", **qkw)[:3] for kk, vv in (first, second)]
    out, smax, ssum = torch_npu.npu_ring_attention_update(*parts[0], *parts[1], input_layout="TND",
                                                          actual_seq_qlen=torch.tensor([0, 6, 16]))
    gkw = dict(head_num=heads, input_layout="TND", actual_seq_qlen=cum(lens), actual_seq_kvlen=cum(lens), scale=0.3)
    red = fa_reductions(q, k, v, layout="TND", head_num=heads, actual_seq_qlen=cum(lens), actual_seq_kvlen=cum(lens))
    assert_close_to_golden("out", out, fa_forward(q, k, v, **gkw)[0], fa_forward(q, k, v, dtype=q.dtype, **gkw)[0],
                           reduction=red["out"])
    # ring backward: each step's grad call gets the merged out and statistics
    dq = torch.zeros_like(q)
    dk, dv = [], []
    for kk, vv in (first, second):
        g = torch_npu.npu_fusion_attention_grad(q, kk, vv, dy, heads, "TND", softmax_max=smax, softmax_sum=ssum,
                                                attention_in=out, scale_value=0.3, actual_seq_qlen=cum(lens),
                                                actual_seq_kvlen=[3, 8])
        dq += g[0]
        dk.append(g[1])
        dv.append(g[2])
    order = lambda a, b: torch.cat([a[0:3], b[0:3], a[3:8], b[3:8]])  # noqa: E731  back to the full order
    gold, base = fa_backward(dy, q, k, v, **gkw), fa_backward(dy, q, k, v, dtype=q.dtype, **gkw)
    for name, actual, g, bl in zip(("dq", "dk", "dv"), (dq, order(*dk), order(*dv)), gold, base):
        assert_close_to_golden(name, actual, g, bl, factor=3.0, reduction=red[name])


def test_vllm_ascend_tnd_paged_fused_infer_attention_matches_golden():
    heads, kv_heads, d, block = 4, 2, 16, 16
    q_lens, kv_lens = [3, 1, 5], [20, 33, 5]
    query = randn(sum(q_lens), heads, d, seed=40)
    cache_k, cache_v = randn(10, block, kv_heads * d, seed=41), randn(10, block, kv_heads * d, seed=42)
    block_table = torch.tensor([[3, 0, -1], [1, 7, 9], [5, -1, -1]], dtype=torch.int32)
    kw = dict(block_table=block_table, input_layout="TND", block_size=block, actual_seq_lengths=cum(q_lens),
              actual_seq_lengths_kv=kv_lens, num_heads=heads, num_key_value_heads=kv_heads, scale=d ** -0.5,
              sparse_mode=3, atten_mask=TRIU2048)
    out = torch_npu.npu_fused_infer_attention_score(query=query, key=cache_k, value=cache_v, **kw)[0]
    ws = torch_npu._npu_fused_infer_attention_score_get_max_workspace(query, cache_k, cache_v, **kw)
    out_buf, lse_buf = torch.empty_like(out), torch.empty(0)
    torch_npu.npu_fused_infer_attention_score.out(query, cache_k, cache_v, workspace=ws, out=[out_buf, lse_buf],
                                                  softmax_lse_flag=True, **kw)
    gkw = {**kw, "scale_value": kw["scale"]}
    del gkw["scale"]
    gold = golden_fia.fia_forward(query, cache_k, cache_v, softmax_lse_flag=True, **gkw)
    base = golden_fia.fia_forward(query, cache_k, cache_v, softmax_lse_flag=True, dtype=query.dtype, **gkw)
    red = fia_reduction(query, cache_k, **gkw)
    assert_close_to_golden("out", out, gold[0], base[0], reduction=red)
    assert torch.equal(out_buf, out)
    assert lse_buf.shape == (sum(q_lens), heads, 1)
    assert_close_to_golden("lse", lse_buf, gold[1], base[1], reduction=red)


def _nsa_inputs():
    n1, d = 2, 16
    q, k, v = (randn(256, n, d, seed=s).requires_grad_() for s, n in ((50, n1), (51, 1), (52, 1)))
    wk, wv = (randn(32, 1, seed=s, scale=0.2).requires_grad_() for s in (53, 54))
    cmp_mask = (torch.arange(7) * 16 + 31).unsqueeze(0) > torch.arange(128).unsqueeze(1)  # complete blocks only
    return q, k, v, wk, wv, cmp_mask


def _nsa_chain_torch_npu(q, k, v, wk, wv, cmp_mask, scale):
    seq = [128, 256]
    kc = torch_npu.npu_nsa_compress(k, wk, 32, 16, actual_seq_len=seq)
    vc = torch_npu.npu_nsa_compress(v, wv, 32, 16, actual_seq_len=seq)
    out_c, topk, _, _ = torch_npu.npu_nsa_compress_attention(
        q, kc, vc, scale, 2, 32, 16, 64, 2, atten_mask=cmp_mask, actual_seq_qlen=seq, actual_cmp_seq_kvlen=[7, 14],
        actual_sel_seq_kvlen=[2, 4])
    out_s, _, _ = torch_npu.npu_nsa_select_attention(q, k, v, topk, scale, 2, 64, 2,
                                                     atten_mask=torch.ones(1, 1, dtype=torch.bool),
                                                     actual_seq_qlen=seq, actual_seq_kvlen=seq)
    return kc, vc, out_c, topk, out_s


def test_nsa_compress_then_compress_attention_then_select_attention_with_gradients():
    q, k, v, wk, wv, cmp_mask = _nsa_inputs()
    scale, seq = 0.25, [128, 256]
    kc, vc, out_c, topk, out_s = _nsa_chain_torch_npu(q, k, v, wk, wv, cmp_mask, scale)
    dy_c, dy_s = randn(*out_c.shape, seed=55), randn(*out_s.shape, seed=56)
    torch.autograd.backward([out_c, out_s], [dy_c, dy_s])
    # the Pythonic API gives the same values and gradients
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v, wk, wv)]
    pq, pk, pv, pwk, pwv = inputs
    pkc = attnops.nsa_compress(pk, pwk, block_size=32, stride=16, actual_seq_len=seq)
    pvc = attnops.nsa_compress(pv, pwv, block_size=32, stride=16, actual_seq_len=seq)
    res = attnops.nsa_compress_attention(pq, pkc, pvc, compress_block_size=32, compress_stride=16,
                                         select_block_size=64, select_block_count=2, scale=scale,
                                         atten_mask=cmp_mask, actual_seq_qlen=seq, actual_cmp_seq_kvlen=[7, 14])
    p_s = attnops.nsa_selected_attention(pq, pk, pv, res.topk_indices, select_block_size=64, causal=True,
                                         scale=scale, actual_seq_qlen=seq, actual_seq_kvlen=seq)
    torch.autograd.backward([res.out, p_s], [dy_c, dy_s])
    assert torch.equal(res.topk_indices, topk) and torch.equal(res.out, out_c) and torch.equal(p_s, out_s)
    for mine, theirs in zip((q, k, v, wk, wv), inputs):
        assert torch.equal(mine.grad, theirs.grad)
    # and the fp64 goldens
    gold_kc = golden_nsa.nsa_compress(k, wk, 32, 16, seq)
    assert_close_to_golden("k_cmp", kc, gold_kc, golden_nsa.nsa_compress(k, wk, 32, 16, seq, dtype=k.dtype),
                           reduction=32)  # one block
    gold = golden_nsa.nsa_compress_attention(q, kc, vc, scale, 2, 32, 16, 64, 2, cmp_mask, None, seq, [7, 14],
                                             [2, 4])
    base = golden_nsa.nsa_compress_attention(q, kc, vc, scale, 2, 32, 16, 64, 2, cmp_mask, None, seq, [7, 14],
                                             [2, 4], dtype=q.dtype)
    assert_close_to_golden("out_cmp", out_c, gold[0], base[0], reduction=q.shape[-1] + 14 - 7)  # 7 compressed keys
    assert torch.equal(topk, gold[1])
    sel = (q, k, v, topk, scale, 64, seq, seq, True)
    red = nsa_reductions(q, k, v, [128, 128], 2 * 64, topk)  # 2 selected blocks of 64 keys
    assert_close_to_golden("out_sel", out_s, golden_nsa.nsa_selected_attention(*sel)[0],
                           golden_nsa.nsa_selected_attention(*sel, dtype=q.dtype)[0], reduction=red["out"])
    out, smax, ssum = torch_npu.npu_nsa_select_attention(q, k, v, topk, scale, 2, 64, 2,
                                                         atten_mask=torch.ones(1, 1, dtype=torch.bool),
                                                         actual_seq_qlen=seq, actual_seq_kvlen=seq)
    grads = torch_npu.npu_nsa_select_attention_grad(dy_s, q, k, v, out, smax, ssum, topk, scale, 2, 64, 2,
                                                    atten_mask=torch.ones(1, 1, dtype=torch.bool),
                                                    actual_seq_qlen=seq, actual_seq_kvlen=seq)
    gold_g = golden_nsa.nsa_selected_attention_backward(dy_s, *sel)
    base_g = golden_nsa.nsa_selected_attention_backward(dy_s, *sel, dtype=q.dtype)
    for name, actual, g, bl in zip(("dq", "dk", "dv"), grads, gold_g, base_g):
        assert_close_to_golden(name, actual, g, bl, factor=3.0, reduction=red[name])


def test_fusion_attention_gradients_equal_the_pythonic_api():
    lens, kv_lens = [5, 0, 9], [7, 3, 9]
    q, k, v, dy = randn(14, 4, 8, seed=60), randn(19, 2, 8, seed=61), randn(19, 2, 8, seed=62), randn(14, 4, 8)
    kw = dict(atten_mask=TRIU2048, sparse_mode=3, actual_seq_qlen=cum(lens), actual_seq_kvlen=cum(kv_lens))
    mine = [x.clone().requires_grad_() for x in (q, k, v)]
    torch_npu.npu_fusion_attention(*mine, 4, "TND", scale=0.4, **kw)[0].backward(dy)
    theirs = [x.clone().requires_grad_() for x in (q, k, v)]
    attnops.flash_attention(*theirs, layout="TND", scale=0.4, **kw).backward(dy)
    for a, b in zip(mine, theirs):
        assert torch.equal(a.grad, b.grad)
