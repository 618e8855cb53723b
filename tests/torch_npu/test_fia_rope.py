"""MLA rope inputs of npu_fused_infer_attention_score(_v2): ``query_rope``/``key_rope`` join each head's D of query
and key in ``Q K^T`` (torch_npu_api.md §4, §11: vllm-ascend's MLA prefill passes them with layout TND)."""
from __future__ import annotations

import math

import pytest
import torch

from attnops import torch_npu
from attnops.testing import golden_fia
from attnops.testing.compare import assert_close_to_golden, fia_reduction
from tests.helpers import TRIU2048, cum, randn

F16, F32 = torch.float16, torch.float32


def _mla_formula(q, qr, k, kr, v, q_lens, kv_lens, scale, group, causal):
    """fp64 ``softmax(scale * (q k^T + q_rope k_rope^T)) v`` per TND batch (causal: bottom-right), and the lse."""
    q, qr, k, kr, v = (x.double() for x in (q, qr, k, kr, v))
    outs, lses, q0, k0 = [], [], 0, 0
    for sq, skv in zip(q_lens, kv_lens):
        kk = k[k0:k0 + skv].repeat_interleave(group, 1)
        kkr = kr[k0:k0 + skv].repeat_interleave(group, 1)
        vv = v[k0:k0 + skv].repeat_interleave(group, 1)
        s = (torch.einsum("qnd,knd->nqk", q[q0:q0 + sq], kk)
             + torch.einsum("qnd,knd->nqk", qr[q0:q0 + sq], kkr)) * scale
        if causal:
            s = s.masked_fill(torch.ones(sq, skv, dtype=torch.bool).triu(skv - sq + 1), -math.inf)
        outs.append(torch.einsum("nqk,knd->qnd", s.softmax(-1), vv))
        lses.append(s.logsumexp(-1).transpose(0, 1).unsqueeze(-1))
        q0, k0 = q0 + sq, k0 + skv
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("dtype", [F16, F32])
@pytest.mark.parametrize("causal", [False, True])
def test_fia_rope_tnd_prefill_matches_the_mla_formula(dtype, causal):
    q_lens, kv_lens, n, nkv, d, dr = [5, 9, 1], [7, 9, 4], 4, 2, 16, 8
    t, tk = sum(q_lens), sum(kv_lens)
    q, qr = randn(t, n, d, dtype=dtype, seed=1), randn(t, n, dr, dtype=dtype, seed=2)
    k, kr = randn(tk, nkv, d, dtype=dtype, seed=3), randn(tk, nkv, dr, dtype=dtype, seed=4)
    v = randn(tk, nkv, d, dtype=dtype, seed=5)
    scale = (d + dr) ** -0.5
    kw = dict(atten_mask=TRIU2048, sparse_mode=3) if causal else {}
    out, lse = torch_npu.npu_fused_infer_attention_score(
        q, k, v, query_rope=qr, key_rope=kr, num_heads=n, num_key_value_heads=nkv, scale=scale, input_layout="TND",
        actual_seq_lengths=cum(q_lens), actual_seq_lengths_kv=cum(kv_lens), softmax_lse_flag=True, **kw)
    g_out, g_lse = _mla_formula(q, qr, k, kr, v, q_lens, kv_lens, scale, n // nkv, causal)
    b_out, b_lse = _mla_formula(*(x.to(dtype).float() for x in (q, qr, k, kr, v)), q_lens, kv_lens, scale,
                                n // nkv, causal)
    b_out = b_out.to(dtype)
    red = fia_reduction(q, k, query_rope=qr, num_heads=n, input_layout="TND", actual_seq_lengths_kv=cum(kv_lens))
    assert out.shape == (t, n, d) and out.dtype == dtype and lse.shape == (t, n, 1)
    assert_close_to_golden("attention_out", out, g_out, b_out, reduction=red)
    assert_close_to_golden("softmax_lse", lse, g_lse, b_lse.float(), reduction=red)


def _golden_with_rope(q, qr, k, kr, v, *, layout, heads, kv_heads, **kw):
    """The FIA golden on ``[q | q_rope]``, ``[k | k_rope]`` and ``[v | 0]`` (exact: zero columns add nothing),
    cut back to V's head dim."""
    packed = layout == "BSH"
    kv_packed = k.dim() == 3 and (packed or "block_table" in kw)

    def cat(x, r, h, pk):
        if not pk:
            return torch.cat([x, r], -1)
        return torch.cat([x.unflatten(-1, (h, -1)), r.unflatten(-1, (h, -1))], -1).flatten(-2)
    dv = v.shape[-1] // kv_heads if kv_packed else v.shape[-1]
    qq, kk = cat(q, qr, heads, packed), cat(k, kr, kv_heads, kv_packed)
    vv = cat(v, torch.zeros_like(kr), kv_heads, kv_packed)
    outs = []
    for dtype in (torch.float64, q.dtype):
        out, lse = golden_fia.fia_forward(qq, kk, vv, num_heads=heads, num_key_value_heads=kv_heads,
                                          input_layout=layout, dtype=dtype, **kw)
        out_packed = layout == "BSH"
        out = (out.unflatten(-1, (heads, -1))[..., :dv].flatten(-2) if out_packed else out[..., :dv])
        outs.append((out, lse))
    return outs


@pytest.mark.parametrize("layout, sq", [("BSH", 1), ("BSND", 3), ("BNSD", 1), ("BNSD_BSND", 4)])
def test_fia_rope_dense_layouts(layout, sq):
    b, n, nkv, skv, d, dr = 2, 4, 2, 11, 16, 8
    shape = {"BSH": lambda s, h, e: (b, s, h * e), "BSND": lambda s, h, e: (b, s, h, e),
             "BNSD": lambda s, h, e: (b, h, s, e), "BNSD_BSND": lambda s, h, e: (b, h, s, e)}[layout]
    q, qr = randn(*shape(sq, n, d), dtype=F16, seed=6), randn(*shape(sq, n, dr), dtype=F16, seed=7)
    k, kr = randn(*shape(skv, nkv, d), dtype=F16, seed=8), randn(*shape(skv, nkv, dr), dtype=F16, seed=9)
    v = randn(*shape(skv, nkv, d), dtype=F16, seed=10)
    kw = dict(actual_seq_lengths_kv=[11, 6], scale_value=0.2, softmax_lse_flag=True)
    if sq > 1:
        kw.update(atten_mask=TRIU2048, sparse_mode=3)
    npu_kw = {("scale" if key == "scale_value" else key): value for key, value in kw.items()}
    out, lse = torch_npu.npu_fused_infer_attention_score(q, k, v, query_rope=qr, key_rope=kr, num_heads=n,
                                                         num_key_value_heads=nkv, input_layout=layout, **npu_kw)
    (g_out, g_lse), (b_out, b_lse) = _golden_with_rope(q, qr, k, kr, v, layout=layout, heads=n, kv_heads=nkv, **kw)
    red = fia_reduction(q, k, query_rope=qr, num_heads=n, input_layout=layout, **kw)
    assert out.shape == g_out.shape and out.dtype == F16
    assert_close_to_golden("attention_out", out, g_out, b_out, reduction=red)
    assert_close_to_golden("softmax_lse", lse, g_lse, b_lse, reduction=red)


@pytest.mark.parametrize("cache", ["blocknum_blocksize_H", "blocknum_N_blocksize_D"])
def test_fia_rope_paged_decode(cache):
    """MLA decode: one query row per request, a latent cache read through block_table, its rope cache beside it."""
    b, n, nkv, d, dr, bs, lens = 2, 4, 2, 16, 8, 4, [9, 6]
    blocks = 8
    table = torch.tensor([[5, 0, 2], [7, 3, -1]], dtype=torch.int32)
    q, qr = randn(b, n, 1, d, dtype=F16, seed=11), randn(b, n, 1, dr, dtype=F16, seed=12)
    if cache == "blocknum_blocksize_H":
        k, kr = randn(blocks, bs, nkv * d, dtype=F16, seed=13), randn(blocks, bs, nkv * dr, dtype=F16, seed=14)
    else:
        k, kr = randn(blocks, nkv, bs, d, dtype=F16, seed=13), randn(blocks, nkv, bs, dr, dtype=F16, seed=14)
    kw = dict(block_table=table, block_size=bs, actual_seq_lengths_kv=lens, scale_value=0.2, softmax_lse_flag=True)
    npu_kw = {("scale" if key == "scale_value" else key): value for key, value in kw.items()}
    out, lse = torch_npu.npu_fused_infer_attention_score(q, k, k, query_rope=qr, key_rope=kr, num_heads=n,
                                                         num_key_value_heads=nkv, input_layout="BNSD", **npu_kw)
    (g_out, g_lse), (b_out, b_lse) = _golden_with_rope(q, qr, k, kr, k, layout="BNSD", heads=n, kv_heads=nkv, **kw)
    red = fia_reduction(q, k, query_rope=qr, num_heads=n, input_layout="BNSD", **kw)
    assert out.shape == (b, n, 1, d)
    assert_close_to_golden("attention_out", out, g_out, b_out, reduction=red)
    assert_close_to_golden("softmax_lse", lse, g_lse, b_lse, reduction=red)


def _nz(cache):
    """The NZ ``[blocknum, KV_N, D/16, blocksize, 16]`` form of a fp16 ``[blocknum, KV_N, blocksize, D]`` cache."""
    return cache.unflatten(-1, (-1, 16)).transpose(2, 3).contiguous()


@pytest.mark.parametrize("layout", ["BNSD", "TND"])
def test_fia_rope_nz_caches_as_the_v3_doc_shapes_them(layout):
    """MLA with NZ caches (D = 512, Dr = 64, KV_N = 1, fp16): key and value ``[blocknum, 1, 512/16, blocksize, 16]``
    and ``key_rope`` ``[blocknum, 1, 64/16, blocksize, 16]`` (``key_rope`` takes key's format), against the golden
    of the same caches in the ND ``[blocknum, KV_N, blocksize, D]`` form."""
    b, n, nkv, d, dr, bs, lens = 2, 2, 1, 512, 64, 16, [29, 17]
    table = torch.tensor([[3, 0], [5, 1]], dtype=torch.int32)
    k, kr = randn(6, nkv, bs, d, dtype=F16, seed=15), randn(6, nkv, bs, dr, dtype=F16, seed=16)
    q, qr = randn(b, n, 1, d, dtype=F16, seed=17), randn(b, n, 1, dr, dtype=F16, seed=18)
    kw = dict(block_table=table, block_size=bs, actual_seq_lengths_kv=lens, scale_value=(d + dr) ** -0.5,
              softmax_lse_flag=True)
    (g_out, g_lse), (b_out, b_lse) = _golden_with_rope(q, qr, k, kr, k, layout="BNSD", heads=n, kv_heads=nkv, **kw)
    red = fia_reduction(q, k, query_rope=qr, num_heads=n, input_layout="BNSD", **kw)
    npu_kw = {("scale" if key == "scale_value" else key): value for key, value in kw.items()}
    if layout == "TND":  # one query token per request
        q, qr, g_out, b_out = (x.transpose(1, 2).flatten(0, 1) for x in (q, qr, g_out, b_out))
        g_lse, b_lse = (x.transpose(1, 2).flatten(0, 1) for x in (g_lse, b_lse))
        npu_kw["actual_seq_lengths"] = [1, 2]  # cumulative; a paged KV keeps per-request lengths
    out, lse = torch_npu.npu_fused_infer_attention_score(q, _nz(k), _nz(k), query_rope=qr, key_rope=_nz(kr),
                                                         num_heads=n, num_key_value_heads=nkv, input_layout=layout,
                                                         **npu_kw)
    assert_close_to_golden("attention_out", out, g_out, b_out, reduction=red)
    assert_close_to_golden("softmax_lse", lse, g_lse, b_lse, reduction=red)


def test_fia_rope_nz_key_rope_in_another_form_names_the_nz_form():
    k, q, qr = randn(2, 1, 2, 16, 16, dtype=F16, seed=19), randn(1, 2, 1, 32, dtype=F16), randn(1, 2, 1, 16, dtype=F16)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    for key_rope in (randn(2, 1, 2, 16, 16, dtype=F16), randn(2, 1, 16, 16, dtype=F16)):  # [.., D/16, bs, Dr], ND
        with pytest.raises(ValueError, match=r"key_rope: expected an NZ cache like key with query_rope's Dr=16: "
                                             r"\[blocknum=2, KV_N=1, Dr/16=1, blocksize=16, 16\]"):
            torch_npu.npu_fused_infer_attention_score(q, k, k, query_rope=qr, key_rope=key_rope, num_heads=2,
                                                      num_key_value_heads=1, input_layout="BNSD", block_table=table,
                                                      block_size=16, actual_seq_lengths_kv=[20])


def test_fia_v2_rope_with_learnable_sink_and_out_overload():
    q_lens, n, d, dr = [3, 5], 2, 16, 8
    t = sum(q_lens)
    q, qr, k, kr, v = (randn(t, n, e, dtype=F32, seed=20 + i) for i, e in enumerate((d, dr, d, dr, d)))
    sink = torch.tensor([0.5, -1.0])
    kw = dict(query_rope=qr, key_rope=kr, num_query_heads=n, softmax_scale=0.25, input_layout="TND",
              actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(q_lens), return_softmax_lse=True)
    out, lse = torch_npu.npu_fused_infer_attention_score_v2(q, k, v, learnable_sink=sink, **kw)
    plain, plain_lse = torch_npu.npu_fused_infer_attention_score_v2(q, k, v, **kw)
    red = fia_reduction(q, k, query_rope=qr, num_heads=n, input_layout="TND", actual_seq_lengths_kv=cum(q_lens))
    g_out, g_lse = _mla_formula(q, qr, k, kr, v, q_lens, q_lens, 0.25, 1, False)
    assert_close_to_golden("attention_out", plain, g_out, g_out.float(), reduction=red)
    weights = torch.sigmoid(g_lse - sink.double().view(1, -1, 1))
    assert_close_to_golden("attention_out(sink)", out, g_out * weights, (g_out * weights).float(),
                           reduction=red + 1)  # the sink is one more key
    assert_close_to_golden("softmax_lse", lse, torch.logaddexp(g_lse, sink.double().view(1, -1, 1)), plain_lse,
                           reduction=red + 1)
    target = [torch.empty(0), torch.empty(0)]
    torch_npu.npu_fused_infer_attention_score_v2.out(q, k, v, out=target, **kw)
    assert torch.equal(target[0], plain) and torch.equal(target[1], plain_lse)


def _tnd(n=2, d=16, dr=8, t=4):
    return [randn(t, n, e, dtype=F16, seed=30 + i) for i, e in enumerate((d, dr, d, dr, d))]


@pytest.mark.parametrize("argument", ["quant_scale2", "antiquant_scale", "key_shared_prefix"])
def test_fia_rope_rejects_what_it_does_not_combine_with(argument):
    q, qr, k, kr, v = _tnd()
    with pytest.raises(NotImplementedError, match=argument):
        torch_npu.npu_fused_infer_attention_score(q, k, v, query_rope=qr, key_rope=kr, num_heads=2,
                                                  input_layout="TND", actual_seq_lengths=[4],
                                                  actual_seq_lengths_kv=[4], **{argument: torch.ones(1)})


def test_fia_rope_argument_errors_name_the_argument():
    q, qr, k, kr, v = _tnd()
    kw = dict(num_heads=2, input_layout="TND", actual_seq_lengths=[4], actual_seq_lengths_kv=[4])
    with pytest.raises(ValueError, match="key_rope"):
        torch_npu.npu_fused_infer_attention_score(q, k, v, query_rope=qr, **kw)
    with pytest.raises(ValueError, match="query_rope"):
        torch_npu.npu_fused_infer_attention_score(q, k, v, query_rope=qr[:3], key_rope=kr, **kw)
    with pytest.raises((TypeError, ValueError), match="key_rope"):
        torch_npu.npu_fused_infer_attention_score(q, k, v, query_rope=qr, key_rope=kr.float(), **kw)
    with pytest.raises(ValueError, match="value"):
        torch_npu.npu_fused_infer_attention_score(q, k, randn(4, 2, 32, dtype=F16), query_rope=qr, key_rope=kr, **kw)
    for cache_dtype in (torch.bfloat16, torch.float32):  # a cache dtype unlike the query's blames key, not the rope
        with pytest.raises(ValueError, match=r"^key: expected dtype torch.float16 \(same as query\)"):
            torch_npu.npu_fused_infer_attention_score(q, k.to(cache_dtype), v.to(cache_dtype), query_rope=qr,
                                                      key_rope=kr, **kw)
    bq, bqr = q[None, :1].transpose(1, 2), qr[None, :1].transpose(1, 2)  # BNSD, Q_S = 1
    bk, bkr, bv = (x[None].transpose(1, 2) for x in (k, kr, v))
    with pytest.raises(ValueError, match="sparse_mode"):
        torch_npu.npu_fused_infer_attention_score(bq, bk, bv, query_rope=bqr, key_rope=bkr, num_heads=2,
                                                  input_layout="BNSD", sparse_mode=4, pre_tokens=2, next_tokens=0,
                                                  atten_mask=TRIU2048)


def test_fia_rope_paged_reads_only_the_named_pages():
    """A large cache of which the table names a few pages, one shared by both requests (a common prefix): the
    same result as the golden; a needed id past the cache is reported in the caller's terms."""
    b, n, nkv, d, dr, bs = 2, 4, 1, 16, 8, 4
    q, qr = randn(b, n, 1, d, dtype=F16, seed=40), randn(b, n, 1, dr, dtype=F16, seed=41)
    k, kr = randn(64, bs, nkv * d, dtype=F16, seed=42), randn(64, bs, nkv * dr, dtype=F16, seed=43)
    table = torch.tensor([[50, 3, -1], [50, 63, -1]], dtype=torch.int32)
    kw = dict(block_table=table, block_size=bs, actual_seq_lengths_kv=[8, 5], scale_value=0.2,
              softmax_lse_flag=True)
    npu_kw = {("scale" if key == "scale_value" else key): value for key, value in kw.items()}
    out, lse = torch_npu.npu_fused_infer_attention_score(q, k, k, query_rope=qr, key_rope=kr, num_heads=n,
                                                         num_key_value_heads=nkv, input_layout="BNSD", **npu_kw)
    red = fia_reduction(q, k, query_rope=qr, num_heads=n, input_layout="BNSD", **kw)
    (g_out, g_lse), (b_out, b_lse) = _golden_with_rope(q, qr, k, kr, k, layout="BNSD", heads=n, kv_heads=nkv, **kw)
    assert_close_to_golden("attention_out", out, g_out, b_out, reduction=red)
    assert_close_to_golden("softmax_lse", lse, g_lse, b_lse, reduction=red)
    npu_kw.update(block_table=torch.tensor([[50, 3, 12345], [7, 63, -1]], dtype=torch.int32),
                  actual_seq_lengths_kv=[9, 5])  # request 0 needs its third page, id 12345
    with pytest.raises(ValueError, match=r"block_table.*\[0, 64\).*block_table\[0, \d\] = 12345"):
        torch_npu.npu_fused_infer_attention_score(q, k, k, query_rope=qr, key_rope=kr, num_heads=n,
                                                  num_key_value_heads=nkv, input_layout="BNSD", **npu_kw)


def test_referenced_pages_renumbers_and_keeps_the_block_count():
    from attnops.torch_npu.infer_attention import _referenced_pages

    cache = torch.arange(10.0).view(10, 1, 1)
    table, (cut,) = _referenced_pages(torch.tensor([[7, 2, -1], [7, 9, -1]], dtype=torch.int32), cache)
    assert table.tolist() == [[1, 0, -1], [1, 2, -1]] and table.dtype == torch.int32
    assert cut.flatten().tolist() == [2.0, 7.0, 9.0, 0.0, 0.0, 0.0]  # 3 pages named, 6 entries: 3 zero pages
    same, (whole,) = _referenced_pages(torch.tensor([[7, 12]]), cache)  # 12 is past the cache: left to the operator
    assert same.tolist() == [[7, 12]] and whole is cache
