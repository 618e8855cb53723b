"""Spec review of ``attnops.torch_npu``: tests written from ``torch_npu_api.md``, the 2.14.0 schemas and
``cann_semantics.md`` (not from our code), calling the functions the way MindSpeed, vllm-ascend and the op-plugin
docs do, and judging against the fp64 goldens of ``attnops.testing`` with FlashAttention's tolerance rule.

Each test quotes the spec line it checks.
"""
from __future__ import annotations

import math

import pytest
import torch

from attnops import torch_npu
from attnops.testing import golden_fia, golden_nsa
from attnops.testing.compare import assert_close_to_golden, attention_reductions, fa_reductions, fia_reduction
from attnops.testing.golden import FLT_LOWEST, FLT_MAX, fa_backward, fa_forward
from tests.helpers import PREFIX3072, TRIU2048, cum, make_qkv, randn
from tests.ops.nsa.nsa_helpers import nsa_reductions

F16 = torch.float16
INT_MAX = 2147483647


# ------------------------------------------------------------------------------------------- npu_fusion_attention
def _fa_red(q, k, v, gkw) -> dict[str, int]:
    """The reduction lengths of a FlashAttention golden call's outputs (``gkw``: the golden's keywords)."""
    red = fa_reductions(q, k, v, layout=gkw["input_layout"], head_num=gkw["head_num"],
                        actual_seq_qlen=gkw.get("actual_seq_qlen"), actual_seq_kvlen=gkw.get("actual_seq_kvlen"))
    return dict(red, attention_out=red["out"], max=red["softmax_max"], sum=red["softmax_sum"])


def _stats_shape(layout, q, n, b, sq):
    # §1.4: "non-TND: [B, head_num, Sq, 8] whatever the layout (SBH still gives B,N,S). TND: [T, N, 8]"
    return (q.shape[0], n, 8) if layout == "TND" else (b, n, sq, 8)


def _fa_case(layout, *, b=2, n1=2, n2=None, sq=5, skv=None, d=16, dv=None, q_lens=None, kv_lens=None,
             dtype=F16, seed=0, scale=0.3, backward=True, pse=None, softmax_layout="", **npu_kw):
    """Forward (positional head_num/layout as MindSpeed) + grad (keyword names of §2.1) against the golden."""
    q, k, v, dy = make_qkv(layout, b=b, n1=n1, n2=n2, sq=sq, skv=skv, d=d, dv=dv, q_lens=q_lens, kv_lens=kv_lens,
                           dtype=dtype, seed=seed)
    if layout == "TND":
        npu_kw.update(actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(kv_lens))
    res = torch_npu.npu_fusion_attention(q, k, v, n1, layout, pse=pse, scale=scale, softmax_layout=softmax_layout,
                                         **npu_kw)
    assert len(res) == 7
    out, smax, ssum, soft, seed_, offset, numels = res
    # §1.4 outputs
    assert out.dtype == q.dtype and smax.dtype == ssum.dtype == torch.float32
    assert soft.shape == (0,) and soft.dtype == q.dtype  # "reserved: torch.empty([0])", query.dtype
    assert all(type(x) is int for x in (seed_, offset, numels))
    sq_ = sq if layout != "TND" else None
    assert smax.shape == ssum.shape == _stats_shape(layout, q, n1, b, sq_)
    assert torch.equal(smax, smax[..., :1].expand_as(smax))  # "the same value replicated 8 times"
    gkw = dict(head_num=n1, input_layout=layout, pse=pse, scale=scale,
               atten_mask=npu_kw.get("atten_mask"), pre_tokens=npu_kw.get("pre_tockens", INT_MAX),
               next_tokens=npu_kw.get("next_tockens", INT_MAX), prefix=npu_kw.get("prefix"),
               actual_seq_qlen=npu_kw.get("actual_seq_qlen"), actual_seq_kvlen=npu_kw.get("actual_seq_kvlen"),
               sparse_mode=npu_kw.get("sparse_mode", 0), softmax_layout=softmax_layout)
    g = fa_forward(q, k, v, **gkw)
    bl = fa_forward(q, k, v, dtype=q.dtype, **gkw)
    assert out.shape == g[0].shape
    red = _fa_red(q, k, v, gkw)
    for name, a, gg, bb in zip(("attention_out", "softmax_max", "softmax_sum"), (out, smax, ssum), g, bl):
        assert_close_to_golden(name, a, gg, bb, reduction=red[name])
    if not backward:
        return out
    # §2.1: keyword-only after input_layout; scale is "scale_value" here; seed/offset/numels from the forward
    grad_kw = {k_: npu_kw[k_] for k_ in ("atten_mask", "pre_tockens", "next_tockens", "prefix", "actual_seq_qlen",
                                         "actual_seq_kvlen", "sparse_mode") if k_ in npu_kw}
    grads = torch_npu.npu_fusion_attention_grad(
        q, k, v, dy, n1, layout, pse=pse, padding_mask=None, softmax_max=smax, softmax_sum=ssum, softmax_in=soft,
        attention_in=out, scale_value=scale, keep_prob=1.0, inner_precise=0, seed=seed_, offset=offset,
        numels=numels, softmax_layout=softmax_layout, **grad_kw)
    assert len(grads) == 5
    dq, dk, dv, dpse, dsink = grads
    # §2.2: "dpse: an undefined tensor -> Python None when pse is None"; "dsink: torch.empty([0], float32)"
    assert dsink.shape == (0,) and dsink.dtype == torch.float32
    assert (dpse is None) == (pse is None)
    gg = fa_backward(dy, q, k, v, out, **gkw)
    bb = fa_backward(dy, q, k, v, out, dtype=q.dtype, **gkw)
    for name, a, like, x, y in zip(("dq", "dk", "dv", "dpse"), (dq, dk, dv, dpse), (q, k, v, pse), gg, bb):
        if a is not None:
            assert a.shape == like.shape and a.dtype == q.dtype, name  # "The meta gives every one query.dtype"
        assert_close_to_golden(name, a, x, y, factor=3.0, reduction=red[name])
    return out


DENSE = ["BSH", "SBH", "BSND", "BNSD"]


@pytest.mark.parametrize("layout", DENSE)
@pytest.mark.parametrize("mode, kw", [
    (0, dict(pre_tockens=1, next_tockens=0)),           # "0: ... band where -pre <= j - i <= next, top-left"
    (0, dict(pre_tockens=INT_MAX, next_tockens=INT_MAX)),
    (1, dict(pre_tockens=0, next_tockens=0)),           # "1: allMask (pre/next ignored)"
    (2, dict()),                                        # "2: leftUpCausal (j <= i)"
    (3, dict()),                                        # "3: rightDownCausal (j <= i + Skv - Sq)"
    (4, dict(pre_tockens=2, next_tockens=1)),           # "4: band with origin at the bottom-right"
])
def test_fusion_attention_sparse_modes_dense_layouts(layout, mode, kw):
    sq, skv = 5, 7
    if mode in (0, 1):
        mask = torch.rand(2, 1, sq, skv, generator=torch.Generator().manual_seed(3)) < 0.3
        mask[..., 0] = False  # no fully masked row in the user mask (docs forbid it)
    else:
        mask = TRIU2048
    _fa_case(layout, n1=4, n2=2, sq=sq, skv=skv, dv=8, atten_mask=mask, sparse_mode=mode, **kw)


@pytest.mark.parametrize("mode", [2, 3])
def test_fusion_attention_causal_with_more_queries_than_keys_gives_invalid_rows(mode):
    # §1.1 "For Sq > Skv with mode 3 ... invalid-row mode"; DECISIONS: "output row 0, softmax_max = FLT_LOWEST,
    # softmax_sum = FLT_MAX" for fully-masked rows
    out = _fa_case("BNSD", sq=7, skv=4, atten_mask=TRIU2048, sparse_mode=mode)
    if mode == 3:
        assert torch.all(out[:, :, :3] == 0)


@pytest.mark.parametrize("mode", [1, 2, 3, 4, 0])
def test_fusion_attention_without_mask_is_full_whatever_sparse_mode(mode):
    # §1.2 "If atten_mask is None, sparse_mode, pre_tockens and next_tockens are ignored and attention is full."
    q, k, v, _ = make_qkv("BSND", sq=4, skv=6, dtype=F16)
    out = torch_npu.npu_fusion_attention(q, k, v, 2, "BSND", scale=0.5, sparse_mode=mode, pre_tockens=0,
                                         next_tockens=0)[0]
    full = torch_npu.npu_fusion_attention(q, k, v, 2, "BSND", scale=0.5)[0]
    assert torch.equal(out, full)
    assert_close_to_golden("out", out, fa_forward(q, k, v, head_num=2, input_layout="BSND", scale=0.5)[0],
                           fa_forward(q, k, v, head_num=2, input_layout="BSND", scale=0.5, dtype=F16)[0],
                           reduction=_fa_red(q, k, v, dict(head_num=2, input_layout="BSND"))["out"])


@pytest.mark.parametrize("mode", [5, 6])
def test_fusion_attention_prefix_modes(mode):
    # §1.2 "5: prefix, uncompressed (mask BNSS/B1SS; prefix = per-batch N). 6: prefix, compressed (3072x2048)"
    # cann_semantics §1.1: keep iff j <= i + delta or j < prefix[b]; prefix in [Skv - Sq, Skv] when Sq <= Skv
    sq, skv, prefix = 4, 6, [3, 5]
    if mode == 5:
        i, j = torch.arange(sq).view(-1, 1), torch.arange(skv).view(1, -1)
        mask = torch.stack([~((j <= i + skv - sq) | (j < p)) for p in prefix]).unsqueeze(1)  # B1SS
    else:
        mask = PREFIX3072
    _fa_case("BSH", sq=sq, skv=skv, atten_mask=mask, sparse_mode=mode, prefix=prefix)


@pytest.mark.parametrize("mode, kw", [
    (0, dict(pre_tockens=2, next_tockens=1)),
    (1, dict()),
    (2, dict()),
    (3, dict()),
    (4, dict(pre_tockens=1, next_tockens=0)),
    (6, dict(prefix=[2, 4, 3])),
    (7, dict(pre_tockens=6, next_tockens=-1)),   # doc: pre >= last_Skv; last_Sq - last_Skv <= next <= 0
    (8, dict(pre_tockens=6, next_tockens=1)),    # doc: pre >= first_Skv; next >= first_Sq - first_Skv
])
def test_fusion_attention_sparse_modes_tnd(mode, kw):
    # §1.2 "TND accepts sparse modes [0,5) u (5,8]"; §1.3 cumulative lists with no leading 0
    q_lens, kv_lens = [3, 4, 2], [5, 6, 4]
    if mode in (0, 1):
        # "varlen accepts SS only (maxSq x maxSkv)"; each batch uses the top-left slice
        mask = torch.rand(4, 6, generator=torch.Generator().manual_seed(5)) < 0.3
        mask[:, 0] = False
    elif mode == 6:
        mask = PREFIX3072
    else:
        mask = TRIU2048
    _fa_case("TND", n1=4, n2=2, q_lens=q_lens, kv_lens=kv_lens, atten_mask=mask, sparse_mode=mode, **kw)


@pytest.mark.parametrize("softmax_layout", ["", "TND"])
def test_fusion_attention_tnd_zero_length_and_trailing_batches(softmax_layout):
    # §1.3 "A zero-length batch repeats the value: [2,2,0,2,2] -> [2,4,4,6,8]" and "trailing batches can be
    # disabled with trailing zeros: [2,5,9,0,0]"
    q, k, v, dy = make_qkv("TND", n1=2, q_lens=[2, 0, 3], kv_lens=[3, 2, 3], t_extra=2, dtype=F16)
    qlen, kvlen = [2, 2, 5, 0, 0], [3, 5, 8, 0, 0]
    res = torch_npu.npu_fusion_attention(q, k, v, 2, "TND", scale=0.4, actual_seq_qlen=qlen,
                                         actual_seq_kvlen=kvlen, softmax_layout=softmax_layout)
    assert res[6] == 2 * (2 * 3 + 0 * 2 + 3 * 3)  # §1.5 "TND: N * sum_b(sq_b * skv_b)"
    gkw = dict(head_num=2, input_layout="TND", scale=0.4, actual_seq_qlen=qlen, actual_seq_kvlen=kvlen,
               softmax_layout=softmax_layout)
    g, bl = fa_forward(q, k, v, **gkw), fa_forward(q, k, v, dtype=F16, **gkw)
    red = _fa_red(q, k, v, gkw)
    assert_close_to_golden("out", res[0][:5], g[0][:5], bl[0][:5], reduction=red["out"])
    for name, a, gg, bb in zip(("max", "sum"), res[1:3], g[1:3], bl[1:3]):
        assert a.shape == (7, 2, 8)
        assert_close_to_golden(name, a.reshape(-1, 8)[:10], gg.reshape(-1, 8)[:10], bb.reshape(-1, 8)[:10],
                               reduction=red[name])


@pytest.mark.parametrize("layout", ["BSH", "TND"])
def test_fusion_attention_softmax_layout_tnd_and_grad(layout):
    # §1.4 "With softmax_layout="TND" ... the memory is true [T,N,8]"; the grad takes the same softmax_layout
    if layout == "TND":
        _fa_case("TND", n1=2, q_lens=[3, 2], kv_lens=[4, 2], softmax_layout="TND")
        _fa_case("TND", n1=2, q_lens=[3, 2], kv_lens=[4, 2], softmax_layout="")
    else:
        _fa_case("BSH", n1=2)


@pytest.mark.parametrize("shape", ["BNSS", "BN1S", "1NSS"])
def test_fusion_attention_pse_shapes(shape):
    # §1.2 "pse: added before scaling (softmax(scale*(pse + QK^T)), pse_type 1). Shapes BNSS, BN1Skv or 1NSS"
    b, n, sq, skv = 2, 2, 4, 6
    dims = {"BNSS": (b, n, sq, skv), "BN1S": (b, n, 1, skv), "1NSS": (1, n, sq, skv)}[shape]
    pse = randn(*dims, dtype=F16, seed=9)
    _fa_case("BNSD", b=b, n1=n, sq=sq, skv=skv, pse=pse, atten_mask=TRIU2048, sparse_mode=3)


def test_fusion_attention_all_keyword_call_as_vllm_ascend():
    # §1.1 "all-keyword including query=/key=/value=/head_num=/input_layout= (vllm-ascend)"
    q, k, v, _ = make_qkv("TND", n1=2, q_lens=[3, 2], kv_lens=[3, 2], dtype=F16)
    out = torch_npu.npu_fusion_attention(query=q, key=k, value=v, head_num=2, input_layout="TND", scale=0.5,
                                         actual_seq_qlen=[3, 5], actual_seq_kvlen=[3, 5])[0]
    gkw = dict(head_num=2, input_layout="TND", scale=0.5, actual_seq_qlen=[3, 5], actual_seq_kvlen=[3, 5])
    assert_close_to_golden("out", out, fa_forward(q, k, v, **gkw)[0], fa_forward(q, k, v, dtype=F16, **gkw)[0],
                           reduction=_fa_red(q, k, v, gkw)["out"])


def test_fusion_attention_grad_uses_the_given_statistics_not_recomputed_ones():
    # §2.3 "A drop-in must honour the passed-in statistics and must not recompute them from q/k."
    q, k, v, dy = make_qkv("BNSD", sq=4, skv=6, dtype=torch.float32)
    out, smax, ssum = torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD", scale=0.5)[:3]
    shifted = ssum * 2  # P halves
    dq, dk, dv = torch_npu.npu_fusion_attention_grad(q, k, v, dy, 2, "BNSD", softmax_max=smax, softmax_sum=shifted,
                                                     attention_in=out, scale_value=0.5)[:3]
    ref_dv = torch_npu.npu_fusion_attention_grad(q, k, v, dy, 2, "BNSD", softmax_max=smax, softmax_sum=ssum,
                                                 attention_in=out, scale_value=0.5)[2]
    torch.testing.assert_close(dv, ref_dv / 2)


def test_fusion_attention_grad_is_keyword_only_after_input_layout():
    # §2.1 "keyword-only after input_layout"
    q, k, v, dy = make_qkv("BNSD", sq=2, dtype=torch.float32)
    with pytest.raises(TypeError):
        torch_npu.npu_fusion_attention_grad(q, k, v, dy, 2, "BNSD", None)


@pytest.mark.parametrize("form", ["row", "full"])
def test_fusion_attention_flattened_tnd_pse(form):
    # CANN VarLen docs: TND also takes a 1-D pse [N1*sum(Skv_b)] (per-batch [N1, 1, Skv_b]) or
    # [N1*sum(Sq_b*Skv_b)] (per-batch [N1, Sq_b, Skv_b]); dpse has the pse's shape
    n, q_lens, kv_lens = 2, [3, 1, 4], [5, 2, 4]
    rows = [1] * 3 if form == "row" else q_lens
    pse = randn(n * sum(r * c for r, c in zip(rows, kv_lens)), dtype=F16, seed=12)
    _fa_case("TND", n1=n, n2=1, q_lens=q_lens, kv_lens=kv_lens, pse=pse, atten_mask=TRIU2048, sparse_mode=3)


@pytest.mark.parametrize("pse_type, slopes", [(0, None), (2, "N"), (2, "BN"), (3, "N"), (3, "BN")])
def test_fusion_attention_v2_pse_types_with_start_index_lists(pse_type, slopes):
    # §3.1 "0: scale*QK + pse; 2/3: ALiBi generated inside the kernel from slopes (fp32 [N] or [B,N]; 3 = sqrt),
    # with q_start_idx/kv_start_idx (length-1 lists) shifting the diagonal"
    b, n, s = 2, 2, 5
    q, k, v, dy = make_qkv("BSND", b=b, n1=n, sq=s, dtype=F16)
    if pse_type == 0:
        pse = randn(b, n, s, s, dtype=F16, seed=4)
    else:
        pse = (torch.rand(b, n) if slopes == "BN" else torch.rand(n)).float() + 0.1
    kw = dict(pse=pse, scale=0.4, atten_mask=TRIU2048, sparse_mode=2, pse_type=pse_type, q_start_idx=[3],
              kv_start_idx=[1])
    out, smax, ssum, _, seed, offset, numels = torch_npu.npu_fusion_attention_v2(q, k, v, n, "BSND", **kw)
    gkw = dict(head_num=n, input_layout="BSND", pse=pse, scale=0.4, atten_mask=TRIU2048, sparse_mode=2,
               pse_type=pse_type, q_start_idx=3, kv_start_idx=1)
    g, bl = fa_forward(q, k, v, **gkw), fa_forward(q, k, v, dtype=F16, **gkw)
    red = _fa_red(q, k, v, gkw)
    for name, a, gg, bb in zip(("out", "max", "sum"), (out, smax, ssum), g, bl):
        assert_close_to_golden(name, a, gg, bb, reduction=red[name])
    dq, dk, dv, dpse, dq_rope, dk_rope, dsink = torch_npu.npu_fusion_attention_grad_v2(
        q, k, v, dy, n, "BSND", pse=pse, atten_mask=TRIU2048, softmax_max=smax, softmax_sum=ssum, attention_in=out,
        scale_value=0.4, sparse_mode=2, pse_type=pse_type, q_start_idx=[3], kv_start_idx=[1], seed=seed,
        offset=offset, numels=numels)
    assert dq_rope is None and dk_rope is None and dsink.shape == (0,)
    gg, bb = fa_backward(dy, q, k, v, out, **gkw), fa_backward(dy, q, k, v, out, dtype=F16, **gkw)
    for name, a, x, y in zip(("dq", "dk", "dv"), (dq, dk, dv), gg, bb):
        assert_close_to_golden(name, a, x, y, factor=3.0, reduction=red[name])


def test_fusion_attention_autograd_flows_to_q_k_v_and_pse():
    # §1.6: native autograd gives gradients of query, key, value, pse from the gradient of output 0
    q, k, v, dy = make_qkv("SBH", n1=2, sq=4, dtype=torch.float32)
    pse = randn(2, 2, 4, 4, seed=8)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, pse)]
    out = torch_npu.npu_fusion_attention(leaves[0], leaves[1], leaves[2], 2, "SBH", pse=leaves[3], scale=0.3)[0]
    out.backward(dy)
    gkw = dict(head_num=2, input_layout="SBH", pse=pse, scale=0.3)
    gg, bb = fa_backward(dy, q, k, v, **gkw), fa_backward(dy, q, k, v, dtype=torch.float32, **gkw)
    red = _fa_red(q, k, v, gkw)
    for name, leaf, x, y in zip(("dq", "dk", "dv", "dpse"), leaves, gg, bb):
        assert_close_to_golden(name, leaf.grad, x, y, factor=3.0, reduction=red[name])


# ------------------------------------------------------------------------------------------- FIA / PFA / IFA
def _fia_judge(out, lse, q, k, v, **gkw):
    g_out, g_lse = golden_fia.fia_forward(q, k, v, **gkw)
    b_out, b_lse = golden_fia.fia_forward(q, k, v, dtype=q.dtype, **gkw)
    assert out.dtype == q.dtype and out.shape == g_out.shape
    red = fia_reduction(q, k, **gkw)
    assert_close_to_golden("attention_out", out, g_out, b_out, reduction=red)
    if gkw.get("softmax_lse_flag"):
        assert lse.dtype == torch.float32 and lse.shape == g_lse.shape
        assert_close_to_golden("softmax_lse", lse, g_lse, b_lse, reduction=red)
    else:
        assert lse.shape == (0,)  # §4.3 "With False: the C++ allocates torch.empty([0])"


def _fia_inputs(layout, b, n, nkv, sq, skv, d, seed=0):
    shape = {"BSH": lambda s, h: (b, s, h * d), "BSND": lambda s, h: (b, s, h, d),
             "BNSD": lambda s, h: (b, h, s, d), "BNSD_BSND": lambda s, h: (b, h, s, d)}[layout]
    return (randn(*shape(sq, n), dtype=F16, seed=seed), randn(*shape(skv, nkv), dtype=F16, seed=seed + 1),
            randn(*shape(skv, nkv), dtype=F16, seed=seed + 2))


@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD", "BNSD_BSND"])
@pytest.mark.parametrize("sq", [1, 4])
def test_fused_infer_attention_dense_layouts_decode_and_prefill(layout, sq):
    # §4.2: "num_key_value_heads ... GQA"; actual_seq_lengths(_kv) "Non-TND: per-batch lengths, not cumulative"
    if layout == "BNSD_BSND" and sq == 1:
        # seed aclnnFusedInferAttentionScoreV2.md: "BNSD_BSND(输入为BNSD时,输出格式为BSND,仅支持Q_S大于1)"
        with pytest.raises(ValueError, match="input_layout"):
            torch_npu.npu_fused_infer_attention_score(*_fia_inputs(layout, 2, 4, 4, 1, 9, 16), num_heads=4,
                                                      input_layout=layout)
        return
    b, n, nkv, skv = 2, 4, 2, 9
    q, k, v = _fia_inputs(layout, b, n, nkv, sq, skv, 16)
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout=layout, actual_seq_lengths_kv=[9, 5],
              softmax_lse_flag=True)
    if sq > 1:
        kw.update(actual_seq_lengths=[4, 3], atten_mask=TRIU2048, sparse_mode=3)
    out, lse = torch_npu.npu_fused_infer_attention_score(q, k, v, scale=0.25, **kw)
    _fia_judge(out, lse, q, k, v, scale_value=0.25, **kw)
    assert lse.shape == (b, n, sq, 1)  # §4.3 "[B, N, Q_S, 1]"


@pytest.mark.parametrize("mode, kw", [
    (0, dict(pre_tokens=2, next_tokens=0)),
    (1, dict()),
    (2, dict()),
    (3, dict()),
    (4, dict(pre_tokens=3, next_tokens=1)),
])
def test_fused_infer_attention_sparse_modes(mode, kw):
    # §4.2 "pre_tokens, next_tokens and sparse_mode mean the same as in FA"
    b, n, sq, skv = 2, 2, 5, 8
    q, k, v = _fia_inputs("BNSD", b, n, n, sq, skv, 16, seed=3)
    if mode in (0, 1):
        mask = torch.rand(b, 1, sq, skv, generator=torch.Generator().manual_seed(1)) < 0.3
        mask[..., 0] = False
    else:
        mask = TRIU2048
    kw = dict(num_heads=n, input_layout="BNSD", atten_mask=mask, sparse_mode=mode, softmax_lse_flag=True,
              actual_seq_lengths=[5, 4], actual_seq_lengths_kv=[8, 6], **kw)
    out, lse = torch_npu.npu_fused_infer_attention_score(q, k, v, scale=0.3, **kw)
    _fia_judge(out, lse, q, k, v, scale_value=0.3, **kw)


@pytest.mark.parametrize("inner_precise", [0, 1, 2, 3])
def test_fused_infer_attention_inner_precise_and_fully_masked_rows(inner_precise):
    # §4.2 "inner_precise: bit0 = high-performance; bit1 = invalid-row correction"; DECISIONS: "fully-masked rows
    # (FIA): output row 0; softmax_lse = +inf"
    q, k, v = _fia_inputs("BSND", 1, 2, 2, 4, 4, 16, seed=5)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[2] = True
    kw = dict(num_heads=2, input_layout="BSND", atten_mask=mask, softmax_lse_flag=True)
    out, lse = torch_npu.npu_fused_infer_attention_score(q, k, v, scale=0.3, inner_precise=inner_precise, **kw)
    _fia_judge(out, lse, q, k, v, scale_value=0.3, **kw)
    assert torch.all(out[:, 2] == 0) and torch.all(lse[:, :, 2] == math.inf)


def test_fused_infer_attention_tnd_dense_cumulative():
    # §4.2 "TND/NTD: cumulative (prefix sums, no leading 0)"; §4.3 lse "[T, N, 1]"
    q = randn(7, 4, 16, dtype=F16)
    k, v = randn(10, 2, 16, dtype=F16, seed=1), randn(10, 2, 16, dtype=F16, seed=2)
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="TND", actual_seq_lengths=[3, 7],
              actual_seq_lengths_kv=[5, 10], atten_mask=TRIU2048, sparse_mode=3, softmax_lse_flag=True)
    out, lse = torch_npu.npu_fused_infer_attention_score(q, k, v, scale=0.25, **kw)
    assert lse.shape == (7, 4, 1)
    _fia_judge(out, lse, q, k, v, scale_value=0.25, **kw)


@pytest.mark.parametrize("cache", ["BBH", "BNBD"])
@pytest.mark.parametrize("layout", ["TND", "BNSD"])
def test_fused_infer_attention_paged_kv_per_request_lengths(cache, layout):
    # §4.2 page attention: "actual_seq_lengths_kv holds per-request KV lengths, not cumulative, while the query side
    # stays cumulative"; cache "(blocknum, block_size, KV_N*D), (blocknum, KV_N, block_size, D)" (the seed allows
    # the second form for query layout BNSD (and TND), "当query的inputLayout为BSH、BSND时,kv cache排布只支持
    # (blocknum, blocksize, H)一种格式")
    n, nkv, d, bs = 4, 2, 16, 16
    kv_lens = [20, 37]
    blocks = torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32)
    kc = randn(6, bs, nkv * d, dtype=F16, seed=11)
    vc = randn(6, bs, nkv * d, dtype=F16, seed=12)
    if cache == "BNBD":
        kc, vc = (x.view(6, bs, nkv, d).transpose(1, 2).contiguous() for x in (kc, vc))
    if layout == "TND":
        q = randn(5, n, d, dtype=F16)
        kw = dict(input_layout="TND", actual_seq_lengths=[2, 5], atten_mask=TRIU2048, sparse_mode=3)
    else:
        q = randn(2, n, 1, d, dtype=F16)
        kw = dict(input_layout="BNSD")
    kw.update(num_heads=n, num_key_value_heads=nkv, block_table=blocks, block_size=bs,
              actual_seq_lengths_kv=kv_lens, softmax_lse_flag=True)
    out, lse = torch_npu.npu_fused_infer_attention_score(q, kc, vc, scale=0.25, **kw)
    _fia_judge(out, lse, q, kc, vc, scale_value=0.25, **kw)


def test_fused_infer_attention_out_overload():
    # §3.4 "Callers therefore pass out=[attention_out, softmax_lse]" and workspace
    q, k, v = _fia_inputs("BNSD", 1, 2, 2, 3, 5, 16)
    kw = dict(num_heads=2, input_layout="BNSD", softmax_lse_flag=True, scale=0.3)
    ref = torch_npu.npu_fused_infer_attention_score(q, k, v, **kw)
    ws = torch_npu._npu_fused_infer_attention_score_get_max_workspace(q, k, v, **kw)
    o, l = torch.empty_like(ref[0]), torch.empty_like(ref[1])
    res = torch_npu.npu_fused_infer_attention_score.out(q, k, v, workspace=ws, out=[o, l], **kw)
    assert torch.equal(res[0], ref[0]) and torch.equal(o, ref[0]) and torch.equal(l, ref[1])


@pytest.mark.parametrize("layout", ["BSH", "BNSD_BSND", "TND"])
def test_prompt_flash_attention_layouts(layout):
    # §6 "Layouts: BSH, BSND, BNSD, BNSD_BSND (output BSND), TND. actual_seq_lengths(_kv) are per-batch lengths,
    # or cumulative for TND"
    n = 2
    if layout == "TND":
        q, k, v = randn(7, n, 16, dtype=F16), randn(9, n, 16, dtype=F16, seed=1), randn(9, n, 16, dtype=F16, seed=2)
        lens = dict(actual_seq_lengths=[3, 7], actual_seq_lengths_kv=[4, 9])
    else:
        q, k, v = _fia_inputs(layout, 2, n, n, 4, 6, 16)
        lens = dict(actual_seq_lengths=[4, 2], actual_seq_lengths_kv=[6, 5])
    kw = dict(num_heads=n, input_layout=layout, atten_mask=TRIU2048, sparse_mode=3, **lens)
    out = torch_npu.npu_prompt_flash_attention(q, k, v, scale_value=0.3, **kw)
    g = golden_fia.fia_forward(q, k, v, scale_value=0.3, **kw)[0]
    assert out.shape == g.shape
    assert_close_to_golden("out", out, g, golden_fia.fia_forward(q, k, v, scale_value=0.3, dtype=F16, **kw)[0],
                           reduction=fia_reduction(q, k, **kw))


@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4])
def test_prompt_flash_attention_high_precision_modes_remap(mode):
    # §6 "sparse_mode 10-14 means modes 0-4 computed with inner_precise=0"; default next_tokens=0
    q, k, v = _fia_inputs("BNSD", 1, 2, 2, 5, 7, 16, seed=2)
    mask = TRIU2048 if mode >= 2 else (torch.rand(5, 7, generator=torch.Generator().manual_seed(2)) < 0.3)
    if mode < 2:
        mask[:, 0] = False
    kw = dict(num_heads=2, input_layout="BNSD", atten_mask=mask, pre_tokens=3)
    hi = torch_npu.npu_prompt_flash_attention(q, k, v, scale_value=0.3, sparse_mode=10 + mode, **kw)
    lo = torch_npu.npu_prompt_flash_attention(q, k, v, scale_value=0.3, sparse_mode=mode, **kw)
    gkw = dict(kw, sparse_mode=mode, next_tokens=0)  # PFA's default next_tokens
    g = golden_fia.fia_forward(q, k, v, scale_value=0.3, **gkw)[0]
    bl = golden_fia.fia_forward(q, k, v, scale_value=0.3, dtype=F16, **gkw)[0]
    assert_close_to_golden("high precision", hi, g, bl, reduction=fia_reduction(q, k, **gkw))
    assert_close_to_golden("default", lo, g, bl, reduction=fia_reduction(q, k, **gkw))


def test_prompt_flash_attention_without_mask_is_full_despite_next_tokens_zero():
    # §6 "next_tokens defaults to 0. It only matters when a mask is given with sparse_mode 0/4; with no mask,
    # attention is full."
    q, k, v = _fia_inputs("BSH", 2, 2, 2, 4, 6, 16, seed=4)
    out = torch_npu.npu_prompt_flash_attention(q, k, v, num_heads=2, scale_value=0.3)
    g = golden_fia.fia_forward(q, k, v, num_heads=2, scale_value=0.3)[0]
    assert_close_to_golden("out", out, g, golden_fia.fia_forward(q, k, v, num_heads=2, scale_value=0.3,
                                                                  dtype=F16)[0],
                           reduction=fia_reduction(q, k, num_heads=2))


@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
def test_incre_flash_attention_kv_lengths_gqa_and_paged(layout):
    # §7 "actual_seq_lengths holds the KV lengths per batch"; "Layout: BSH for 3-D, BNSD/BSND for 4-D"
    n, nkv, d = 4, 2, 16
    q, k, v = _fia_inputs(layout, 2, n, nkv, 1, 10, d, seed=6)
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout=layout)
    out = torch_npu.npu_incre_flash_attention(q, k, v, scale_value=0.3, actual_seq_lengths=[10, 6], **kw)
    gkw = dict(kw, actual_seq_lengths_kv=[10, 6])
    g = golden_fia.fia_forward(q, k, v, scale_value=0.3, **gkw)[0]
    assert out.shape == q.shape
    assert_close_to_golden("out", out, g, golden_fia.fia_forward(q, k, v, scale_value=0.3, dtype=F16, **gkw)[0],
                           reduction=fia_reduction(q, k, **gkw))
    # paged: (blocknum, block_size, KV_N*D)
    kc = randn(4, 16, nkv * d, dtype=F16, seed=13)
    vc = randn(4, 16, nkv * d, dtype=F16, seed=14)
    table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
    out = torch_npu.npu_incre_flash_attention(q, kc, vc, scale_value=0.3, actual_seq_lengths=[20, 7],
                                              block_table=table, block_size=16, **kw)
    pkw = dict(kw, actual_seq_lengths_kv=[20, 7], block_table=table, block_size=16)
    g = golden_fia.fia_forward(q, kc, vc, scale_value=0.3, **pkw)[0]
    assert_close_to_golden("paged", out, g, golden_fia.fia_forward(q, kc, vc, scale_value=0.3, dtype=F16,
                                                                   **pkw)[0],
                           reduction=fia_reduction(q, kc, **pkw))


# ------------------------------------------------------------------------------------------- merge helpers
def _partials(layout, softmax_layout):
    """Two partial FA results over disjoint KV halves, from npu_fusion_attention itself."""
    if layout == "SBH":
        q, k, v, _ = make_qkv("SBH", b=2, n1=2, sq=4, skv=8, dtype=torch.float32)
        halves = [(k[:4], v[:4]), (k[4:], v[4:])]
        kw = [{}, {}]
        full = dict(head_num=2, input_layout="SBH", scale=0.3)
    else:
        q, k, v, _ = make_qkv("TND", n1=2, q_lens=[3, 2], kv_lens=[4, 6], dtype=torch.float32)
        # first half of each sequence's keys, then the second half
        idx0, idx1 = [0, 1, 4, 5, 6], [2, 3, 7, 8, 9]
        halves = [(k[idx0], v[idx0]), (k[idx1], v[idx1])]
        kw = [dict(actual_seq_qlen=[3, 5], actual_seq_kvlen=[2, 5]), dict(actual_seq_qlen=[3, 5],
                                                                          actual_seq_kvlen=[2, 5])]
        full = dict(head_num=2, input_layout="TND", scale=0.3, actual_seq_qlen=[3, 5], actual_seq_kvlen=[4, 10],
                    softmax_layout=softmax_layout)
    parts = [torch_npu.npu_fusion_attention(q, hk, hv, 2, layout, scale=0.3, softmax_layout=softmax_layout, **a)
             for (hk, hv), a in zip(halves, kw)]
    return q, k, v, parts, full


@pytest.mark.parametrize("layout, softmax_layout", [("SBH", ""), ("TND", ""), ("TND", "TND")])
def test_ring_attention_update_merges_two_kv_halves(layout, softmax_layout):
    # §9 formula; "TND ... needs actual_seq_qlen = an int64 tensor of prefix sums starting at 0";
    # "input_softmax_layout="TND" means true TND statistics; "" means the FA default blocked layout"
    q, k, v, parts, full = _partials(layout, softmax_layout)
    (o1, m1, s1, *_), (o2, m2, s2, *_) = parts
    kw = dict(input_layout=layout)
    if layout == "TND":
        kw.update(actual_seq_qlen=torch.tensor([0, 3, 5], dtype=torch.int64), input_softmax_layout=softmax_layout)
    out, smax, ssum = torch_npu.npu_ring_attention_update(o1, m1, s1, o2, m2, s2, **kw)
    g, bl = fa_forward(q, k, v, **full), fa_forward(q, k, v, dtype=torch.float32, **full)
    red = _fa_red(q, k, v, full)
    for name, a, gg, bb in zip(("out", "max", "sum"), (out, smax, ssum), g, bl):
        assert a.shape == gg.shape
        assert_close_to_golden(name, a, gg, bb, reduction=red[name])


def test_attention_update_merges_lse_chunks():
    # §9 "lse_m = logsumexp(lse_i), O = sum O_i*exp(lse_i - lse_m)"; lse [B*S*N], local_out [B*S*N, D]
    q, k, v = _fia_inputs("BSND", 1, 2, 2, 3, 8, 16)
    q, k, v = q.float(), k.float(), v.float()
    chunks = [torch_npu.npu_fused_infer_attention_score(q, k[:, a:b_], v[:, a:b_], num_heads=2, input_layout="BSND",
                                                        scale=0.3, softmax_lse_flag=True) for a, b_ in ((0, 5), (5, 8))]
    lse = [c[1].permute(0, 2, 1, 3).reshape(-1) for c in chunks]  # [B,N,S,1] -> B*S*N
    outs = [c[0].reshape(-1, 16) for c in chunks]  # BSND -> [B*S*N, D]
    out, lse_out = torch_npu.npu_attention_update(lse, outs, 1)
    gkw = dict(num_heads=2, input_layout="BSND", scale_value=0.3, softmax_lse_flag=True)
    g_out, g_lse = golden_fia.fia_forward(q, k, v, **gkw)
    b_out, b_lse = golden_fia.fia_forward(q, k, v, dtype=torch.float32, **gkw)
    red = fia_reduction(q, k, **gkw)
    assert_close_to_golden("out", out, g_out.reshape(-1, 16), b_out.reshape(-1, 16), reduction=red)
    assert_close_to_golden("lse", lse_out, g_lse.permute(0, 2, 1, 3).reshape(-1),
                           b_lse.permute(0, 2, 1, 3).reshape(-1), reduction=red)


# ------------------------------------------------------------------------------------------- edge cases
def test_fusion_attention_layout_is_upper_cased_and_mask_shapes_and_dtypes():
    # §1.2 "input_layout in BSH, SBH, BSND, BNSD, TND (upper-cased by the C++)"; "atten_mask: bool or uint8 ...
    # Shapes BNSS, B1SS, 11SS or SS"
    q, k, v, _ = make_qkv("BNSD", b=2, n1=2, sq=4, skv=5, dtype=F16)
    base = torch.rand(2, 2, 4, 5, generator=torch.Generator().manual_seed(0)) < 0.4
    base[..., 0] = False
    for mask in (base, base[:, :1], base[:1, :1], base[0, 0], base.to(torch.uint8)):
        out = torch_npu.npu_fusion_attention(q, k, v, 2, "bnsd", atten_mask=mask, scale=0.3, sparse_mode=1)[0]
        gkw = dict(head_num=2, input_layout="BNSD", atten_mask=mask, sparse_mode=1, scale=0.3)
        assert_close_to_golden("out", out, fa_forward(q, k, v, **gkw)[0], fa_forward(q, k, v, dtype=F16, **gkw)[0],
                               reduction=_fa_red(q, k, v, gkw)["out"])


@pytest.mark.parametrize("keep_prob", [0.0, 1.5, -0.1])
def test_fusion_attention_rejects_keep_prob_outside_0_1(keep_prob):
    # §1.5 "The C++ rejects keep_prob outside (0,1] (TORCH_CHECK keep_prob > 0 && keep_prob <= 1)"
    q, k, v, _ = make_qkv("BNSD", sq=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="keep_prob"):
        torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD", keep_prob=keep_prob)


def test_fusion_attention_tnd_head_num_must_match_query():
    # §1.2 "For TND, N and D come from the shape; head_num must equal query.size(1)"
    q, k, v, _ = make_qkv("TND", n1=2, q_lens=[2], kv_lens=[2], dtype=torch.float32)
    with pytest.raises(ValueError, match="head_num"):
        torch_npu.npu_fusion_attention(q, k, v, 4, "TND", actual_seq_qlen=[2], actual_seq_kvlen=[2])


@pytest.mark.parametrize("mode, q_lens, kv_lens, kw", [
    (7, [3, 4, 0], [5, 6, 0], dict(pre_tockens=6, next_tockens=-2)),   # band = last NON-EMPTY batch
    (8, [0, 3, 4], [0, 5, 6], dict(pre_tockens=5, next_tockens=0)),    # band = first non-empty batch
])
def test_fusion_attention_modes_7_8_band_batch_skips_empty_batches(mode, q_lens, kv_lens, kw):
    # cann_semantics §1.1 "7: ... bandIndex = last batch with non-empty length"; "8: ... first non-empty batch"
    _fa_case("TND", n1=2, q_lens=q_lens, kv_lens=kv_lens, atten_mask=TRIU2048, sparse_mode=mode, **kw)


def test_fusion_attention_tnd_empty_kv_batch_gives_invalid_rows():
    # cann_semantics §4.3 "Skv_b = 0 with Sq_b > 0 gives an invalid row" -> out 0, FLT_LOWEST / FLT_MAX
    q, k, v, _ = make_qkv("TND", n1=2, q_lens=[2, 3], kv_lens=[0, 4], dtype=F16)
    out, smax, ssum = torch_npu.npu_fusion_attention(q, k, v, 2, "TND", scale=0.3, actual_seq_qlen=[2, 5],
                                                     actual_seq_kvlen=[0, 4], softmax_layout="TND")[:3]
    assert torch.all(out[:2] == 0) and torch.all(smax[:2] == FLT_LOWEST) and torch.all(ssum[:2] == FLT_MAX)
    gkw = dict(head_num=2, input_layout="TND", scale=0.3, actual_seq_qlen=[2, 5], actual_seq_kvlen=[0, 4])
    assert_close_to_golden("out", out, fa_forward(q, k, v, **gkw)[0], fa_forward(q, k, v, dtype=F16, **gkw)[0],
                           reduction=_fa_red(q, k, v, gkw)["out"])


def test_fusion_attention_mode_0_negative_tokens():
    # cann_semantics §1.1 "next < 0 requires pre >= |next| and |next| < Skv"
    mask = torch.zeros(6, 6, dtype=torch.bool)
    _fa_case("BSND", sq=6, atten_mask=mask, sparse_mode=0, pre_tockens=3, next_tockens=-1)


@pytest.mark.parametrize("kv_lens", [[7], [7, 4, 9]])
def test_fused_infer_attention_short_and_long_length_lists(kv_lens):
    # §4.2 "A length-1 list broadcasts to all batches; a longer list uses its first B entries."
    q, k, v = _fia_inputs("BSND", 2, 2, 2, 3, 8, 16, seed=7)
    kw = dict(num_heads=2, input_layout="BSND", actual_seq_lengths_kv=kv_lens,
              actual_seq_lengths=[3, 2, 1][:len(kv_lens)], softmax_lse_flag=True)
    out, lse = torch_npu.npu_fused_infer_attention_score(q, k, v, scale=0.3, **kw)
    _fia_judge(out, lse, q, k, v, scale_value=0.3, **kw)


@pytest.mark.parametrize("shape", ["QK", "BQK", "1QK", "B1QK", "11QK", "larger"])
def test_fused_infer_attention_prefill_mask_shapes(shape):
    # cann_semantics §1.2 "Full-mask shapes: (Q_S,KV_S), (B,Q_S,KV_S), (1,Q_S,KV_S), (B,1,Q_S,KV_S), (1,1,Q_S,KV_S);
    # the mask may be larger than the actual S"
    b, sq, skv = 2, 4, 6
    q, k, v = _fia_inputs("BNSD", b, 2, 2, sq, skv, 16, seed=8)
    full = torch.rand(b, 1, sq + 2, skv + 3, generator=torch.Generator().manual_seed(8)) < 0.4
    full[..., 0] = False
    mask = {"QK": full[0, 0, :sq, :skv], "BQK": full[:, 0, :sq, :skv], "1QK": full[:1, 0, :sq, :skv],
            "B1QK": full[..., :sq, :skv], "11QK": full[:1, :, :sq, :skv], "larger": full}[shape]
    kw = dict(num_heads=2, input_layout="BNSD", atten_mask=mask, softmax_lse_flag=True)
    out, lse = torch_npu.npu_fused_infer_attention_score(q, k, v, scale=0.3, **kw)
    _fia_judge(out, lse, q, k, v, scale_value=0.3, **kw)


@pytest.mark.parametrize("shape", ["BK", "B1K", "B11K"])
def test_fused_infer_attention_decode_mask_ignores_sparse_mode_and_tokens(shape):
    # §4.2 "In decode, pre_tokens, next_tokens and sparse_mode are ignored unless rope is used";
    # cann_semantics §1.2 "The mask is (B, KV_S), (B,1,KV_S) or (B,1,1,KV_S)"
    b, skv = 2, 7
    q, k, v = _fia_inputs("BSH", b, 2, 2, 1, skv, 16, seed=9)
    m = torch.rand(b, skv, generator=torch.Generator().manual_seed(9)) < 0.4
    m[:, 0] = False
    mask = {"BK": m, "B1K": m[:, None], "B11K": m[:, None, None]}[shape]
    kw = dict(num_heads=2, input_layout="BSH", atten_mask=mask, softmax_lse_flag=True)
    out, lse = torch_npu.npu_fused_infer_attention_score(q, k, v, scale=0.3, pre_tokens=0, next_tokens=0, **kw)
    _fia_judge(out, lse, q, k, v, scale_value=0.3, **kw)
    ifa = torch_npu.npu_incre_flash_attention(q, k, v, atten_mask=mask, num_heads=2, scale_value=0.3)
    assert torch.equal(ifa, out)


# ------------------------------------------------------------------------------------------- sinks, FIA v2
def _sink_golden(q, k, v, sink, scale, keep, dtype=torch.float64):
    """§1.2 (docstring reference): ``probs = softmax(cat([scale*QK^T, sink.view(1,N,1,1)...], -1))[..., :-1]``.

    q ``[B, N, Sq, D]``, k/v ``[B, N, Skv, D]`` (GQA already expanded), keep ``[.., Sq, Skv]`` (False = masked).
    Returns ``out``, ``max`` and ``sum`` of the softmax including the sink, and ``lse = max + log(sum)``."""
    s = scale * (q.to(dtype) @ k.to(dtype).transpose(-1, -2))
    s = s.masked_fill(~keep, -math.inf)
    full = torch.cat([s, sink.to(dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    m = full.amax(-1)
    total = torch.exp(full - m.unsqueeze(-1)).sum(-1)
    out = torch.softmax(full, -1)[..., :-1] @ v.to(dtype)
    return out, m, total, m + total.log()


def _causal_rd(sq, skv):
    return torch.arange(skv).view(1, -1) <= torch.arange(sq).view(-1, 1) + skv - sq


def test_fusion_attention_sink_forward_grad_and_autograd():
    # §1.2 "sink (>=7.3.0): float32 [head_num] ... one extra unscaled logit per head that enters only the
    # denominator"; §1.6 "Gradients are produced for pse and sink when given"; §2.2 dsink "otherwise sink.shape"
    b, n1, n2, sq, skv, d = 2, 4, 2, 5, 7, 16
    q, k, v, dy = make_qkv("BSND", b=b, n1=n1, n2=n2, sq=sq, skv=skv, d=d, dtype=F16, seed=20)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
    scale, keep = 0.3, _causal_rd(sq, skv)
    expand = (lambda x: x.transpose(1, 2).repeat_interleave(n1 // n2, 1))
    leaves = [x.double().requires_grad_() for x in (q, k, v, sink)]
    g_out, g_max, g_sum, _ = _sink_golden(leaves[0].transpose(1, 2), expand(leaves[1]), expand(leaves[2]), leaves[3],
                                          scale, keep)
    g_grads = torch.autograd.grad(g_out.transpose(1, 2), leaves, dy.double())
    bl_leaves = [x.clone().requires_grad_() for x in (q, k, v)] + [sink.half().requires_grad_()]
    b_out, b_max, b_sum, _ = _sink_golden(bl_leaves[0].transpose(1, 2), expand(bl_leaves[1]), expand(bl_leaves[2]),
                                          bl_leaves[3], scale, keep, dtype=F16)
    b_grads = torch.autograd.grad(b_out.transpose(1, 2), bl_leaves, dy)

    mine = [x.clone().requires_grad_() for x in (q, k, v, sink)]
    out, smax, ssum, _, seed, offset, numels = torch_npu.npu_fusion_attention(
        mine[0], mine[1], mine[2], n1, "BSND", atten_mask=TRIU2048, sparse_mode=3, scale=scale, sink=mine[3])
    # the sink is one more key; a KV head's gradient sums over its group's rows; dsink over every batch's rows
    red = dict(attention_reductions(d, d, sq * (n1 // n2), skv + 1), dsink=d + b * sq)
    assert_close_to_golden("out", out, g_out.transpose(1, 2), b_out.transpose(1, 2), reduction=red["out"])
    assert_close_to_golden("softmax_max", smax[..., 0], g_max, b_max.float(), reduction=red["softmax_max"])
    assert_close_to_golden("softmax_sum", ssum[..., 0], g_sum, b_sum.float(), reduction=red["softmax_sum"])
    out.backward(dy)
    names = ("dq", "dk", "dv", "dsink")
    for name, leaf, gg, bb in zip(names, mine, g_grads, b_grads):
        assert leaf.grad.dtype == leaf.dtype
        assert_close_to_golden(name, leaf.grad, gg, bb, factor=3.0, reduction=red[name])
    grads = torch_npu.npu_fusion_attention_grad(
        q, k, v, dy, n1, "BSND", atten_mask=TRIU2048, softmax_max=smax, softmax_sum=ssum, attention_in=out.detach(),
        scale_value=scale, sparse_mode=3, seed=seed, offset=offset, numels=numels, sink=sink)
    assert grads[3] is None and grads[4].shape == (n1,) and grads[4].dtype == torch.float32
    for name, a, leaf in zip(names, grads[:3] + grads[4:], mine):
        torch.testing.assert_close(a, leaf.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("softmax_layout", ["", "TND"])
def test_fusion_attention_sink_tnd_statistics_layouts(softmax_layout):
    # §1.4 TND statistics: default per-batch [N, S_b, 8] blocks, "TND" true [T, N, 8]; the sink changes values only
    q_lens, kv_lens = [3, 2], [4, 5]
    q, k, v, dy = make_qkv("TND", n1=2, q_lens=q_lens, kv_lens=kv_lens, dtype=torch.float32, seed=21)
    sink = torch.tensor([1.0, -0.5])
    out, smax, ssum = torch_npu.npu_fusion_attention(q, k, v, 2, "TND", scale=0.4, sink=sink, atten_mask=TRIU2048,
                                                     sparse_mode=3, actual_seq_qlen=cum(q_lens),
                                                     actual_seq_kvlen=cum(kv_lens), softmax_layout=softmax_layout)[:3]
    stack = ((lambda xs: torch.cat([x.transpose(0, 1) for x in xs])) if softmax_layout == "TND"
             else (lambda xs: torch.cat([x.reshape(-1) for x in xs]).view(5, 2)))

    def golden(dtype):
        outs, maxs, sums = [], [], []
        for qs, ks, a, c in ((0, 0, 3, 4), (3, 4, 2, 5)):
            go, gm, gs, _ = _sink_golden(q[qs:qs + a].transpose(0, 1)[None], k[ks:ks + c].transpose(0, 1)[None],
                                         v[ks:ks + c].transpose(0, 1)[None], sink, 0.4, _causal_rd(a, c), dtype)
            outs.append(go[0].transpose(0, 1))
            maxs.append(gm[0])
            sums.append(gs[0])
        return torch.cat(outs), stack(maxs), stack(sums)

    red = attention_reductions(q.shape[-1], v.shape[-1], max(q_lens), max(kv_lens) + 1)  # the sink: one more key
    for name, a, gg, bb in zip(("out", "max", "sum"), (out, smax[..., 0], ssum[..., 0]), golden(torch.float64),
                               golden(torch.float32)):
        assert_close_to_golden(name, a, gg, bb, reduction=red["out"])


def test_fused_infer_attention_v2_renamed_arguments_tnd_paged_as_vllm_ascend():
    # §5 "Renames relative to v1: actual_seq_lengths -> actual_seq_qlen ... num_heads -> num_query_heads,
    # scale -> softmax_scale, softmax_lse_flag -> return_softmax_lse"; vllm-ascend calls it with TND
    n, nkv, d, bs = 4, 2, 16, 16
    q = randn(5, n, d, dtype=F16, seed=30)
    kc, vc = randn(6, bs, nkv * d, dtype=F16, seed=31), randn(6, bs, nkv * d, dtype=F16, seed=32)
    table = torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32)
    out, lse = torch_npu.npu_fused_infer_attention_score_v2(
        q, kc, vc, num_query_heads=n, num_key_value_heads=nkv, input_layout="TND", softmax_scale=0.25,
        actual_seq_qlen=[2, 5], actual_seq_kvlen=[20, 37], block_table=table, block_size=bs, atten_mask=TRIU2048,
        sparse_mode=3, return_softmax_lse=True)
    gkw = dict(num_heads=n, num_key_value_heads=nkv, input_layout="TND", actual_seq_lengths=[2, 5],
               actual_seq_lengths_kv=[20, 37], block_table=table, block_size=bs, atten_mask=TRIU2048,
               sparse_mode=3, softmax_lse_flag=True)
    _fia_judge(out, lse, q, kc, vc, scale_value=0.25, **gkw)
    _, no_lse = torch_npu.npu_fused_infer_attention_score_v2(q, kc, vc, num_query_heads=n, num_key_value_heads=nkv,
                                                             input_layout="TND", actual_seq_qlen=[2, 5],
                                                             actual_seq_kvlen=[20, 37], block_table=table,
                                                             block_size=bs)
    assert no_lse.shape == (0,)


@pytest.mark.parametrize("layout, sq", [("BSH", 1), ("BNSD", 4), ("BSND", 4)])
def test_fused_infer_attention_v2_learnable_sink(layout, sq):
    # §5 "learnable_sink: bf16 [Q_N]. vllm-ascend uses it for gpt-oss-style sinks"
    b, n, skv, d = 2, 2, 6, 16
    q, k, v = _fia_inputs(layout, b, n, n, sq, skv, d, seed=33)
    sink = torch.tensor([0.75, -0.25], dtype=torch.bfloat16)
    kw = dict(num_query_heads=n, input_layout=layout, softmax_scale=0.3, learnable_sink=sink,
              return_softmax_lse=True)
    if sq > 1:
        kw.update(atten_mask=TRIU2048, sparse_mode=3)
    out, lse = torch_npu.npu_fused_infer_attention_score_v2(q, k, v, **kw)
    to4 = {"BSH": lambda x: x.view(b, -1, n, d).transpose(1, 2), "BNSD": lambda x: x,
           "BSND": lambda x: x.transpose(1, 2)}[layout]
    keep = _causal_rd(sq, skv)
    g_out, _, _, g_lse = _sink_golden(to4(q), to4(k), to4(v), sink, 0.3, keep)
    b_out, _, _, b_lse = _sink_golden(to4(q), to4(k), to4(v), sink, 0.3, keep, dtype=F16)
    assert out.shape == q.shape and lse.shape == (b, n, sq, 1)
    red = fia_reduction(q, k, num_heads=n, input_layout=layout) + 1  # the sink: one more key
    assert_close_to_golden("attention_out", to4(out), g_out, b_out, reduction=red)
    assert_close_to_golden("softmax_lse", lse[..., 0], g_lse, b_lse.float(), reduction=red)


@pytest.mark.parametrize("name", ["npu_fused_infer_attention_score_v2", "npu_fused_infer_attention_score_v2.out"])
def test_fused_infer_attention_v2_signature_matches_schema(name):
    # the 2.14.0 schema (torch_npu_schemas.txt): names, order, keyword-only marker, defaults
    import inspect

    from tests.torch_npu.schemas import load_schemas

    schema = load_schemas()[name]
    op, _, overload = name.partition(".")
    fn = getattr(torch_npu, op)
    fn = getattr(fn, overload) if overload else fn
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params] == [a.name for a in schema.args]
    for p, a in zip(params, schema.args):
        assert p.kind == (inspect.Parameter.KEYWORD_ONLY if a.keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD)
        assert p.default == a.default and type(p.default) is type(a.default), a.name
    q, k = randn(1, 3, 16), randn(1, 5, 16, seed=1)
    if overload:
        o, l = torch.empty(0), torch.empty(0)
        res = fn(q, k, k, out=[o, l], return_softmax_lse=True)
        assert res[0] is o and l.shape == (1, 1, 3, 1)
    else:
        assert torch.equal(fn(q, k, k, softmax_scale=0.5)[0],
                           torch_npu.npu_fused_infer_attention_score(q, k, k, scale=0.5)[0])


# ------------------------------------------------------------------------------------------- NSA
def test_nsa_compress_attention_blocked_statistics_and_autograd():
    # §8.2 "-> (attention_out [T,N1,Dv], topk_indices [T,N2,count] int32, softmax_max [T,N1,8], softmax_sum)";
    # "softmax_max/sum use the per-batch [N, S_b, 8]-blocked layout"; "All training-side actual_* lists are
    # cumulative, with no leading 0"; autograd through the FA grad (derivatives.yaml L319-321)
    q = randn(12, 2, 16, seed=40).requires_grad_()
    kc, vc = randn(12, 1, 16, seed=41).requires_grad_(), randn(12, 1, 8, seed=42).requires_grad_()
    args = (0.3, 2, 32, 16, 64, 1)
    lens = dict(actual_seq_qlen=[5, 12], actual_cmp_seq_kvlen=[3, 12], actual_sel_seq_kvlen=[1, 4])
    out, topk, smax, ssum = torch_npu.npu_nsa_compress_attention(q, kc, vc, *args, **lens)
    gargs = (0.3, 2, 32, 16, 64, 1, None, None, [5, 12], [3, 12], [1, 4])
    gold = golden_nsa.nsa_compress_attention(q, kc, vc, *gargs)
    base = golden_nsa.nsa_compress_attention(q, kc, vc, *gargs, dtype=torch.float32)
    assert topk.dtype == torch.int32 and topk.shape == (12, 1, 1) and torch.equal(topk, gold[1])
    red = nsa_reductions(q, kc, vc, [5, 7], 9)  # at most 9 compressed keys a row
    red.update(max=red["softmax_max"], sum=red["softmax_sum"])
    for name, a, g, bl in zip(("out", "max", "sum"), (out, smax, ssum), gold[::2] + gold[3:], base[::2] + base[3:]):
        assert a.dtype == (q.dtype if name == "out" else torch.float32)
        assert_close_to_golden(name, a, g, bl, reduction=red[name])
    dy = randn(*out.shape, seed=43)
    out.backward(dy)
    gg = golden_nsa.nsa_compress_attention_backward(dy, q, kc, vc, *gargs)
    bb = golden_nsa.nsa_compress_attention_backward(dy, q, kc, vc, *gargs, dtype=torch.float32)
    for name, leaf, g, bl in zip(("dq", "dk", "dv"), (q, kc, vc), gg, bb):
        assert_close_to_golden(name, leaf.grad, g, bl, factor=3.0, reduction=red[name])


@pytest.mark.parametrize("masked", [False, True])
def test_nsa_select_attention_token_major_statistics_and_grad_order(masked):
    # §8.3 "softmax_max/sum here are true [T1,N1,8] (token-major)"; "grad comes first in the grad op";
    # DECISIONS: the forward is causal with an atten_mask present (without a mask the NPU forces mode 0);
    # the grad is causal in mode 2 with or without a mask (the masked gradient of the given forward outputs)
    q, k, v = randn(9, 4, 16, seed=44), randn(20, 2, 16, seed=45), randn(20, 2, 8, seed=46)
    topk = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32).repeat(9, 1, 1)[:, :2]
    lens = dict(actual_seq_qlen=[4, 9], actual_seq_kvlen=[8, 20])
    mask = torch.ones(1, 1, dtype=torch.bool) if masked else None
    out, smax, ssum = torch_npu.npu_nsa_select_attention(q, k, v, topk, 0.3, 4, 4, 2, atten_mask=mask, **lens)
    sel = (q, k, v, topk, 0.3, 4, [4, 9], [8, 20], masked)
    gold, base = golden_nsa.nsa_selected_attention(*sel), golden_nsa.nsa_selected_attention(*sel, dtype=torch.float32)
    red = nsa_reductions(q, k, v, [4, 5], 2 * 4, topk)  # two selected blocks of 4 keys
    red.update(max=red["softmax_max"], sum=red["softmax_sum"])
    for name, a, g, bl in zip(("out", "max", "sum"), (out, smax, ssum), gold, base):
        assert_close_to_golden(name, a, g, bl, reduction=red[name])
    dy = randn(*out.shape, seed=47)
    grads = torch_npu.npu_nsa_select_attention_grad(dy, q, k, v, out, smax, ssum, topk, 0.3, 4, 4, 2,
                                                    atten_mask=mask, **lens)
    gargs = (topk, 0.3, 4, [4, 9], [8, 20], True)
    gg = golden_nsa.nsa_selected_attention_grad_from_stats(dy, q, k, v, *gold, *gargs)
    bb = golden_nsa.nsa_selected_attention_grad_from_stats(dy, q, k, v, *base, *gargs, dtype=torch.float32)
    for name, a, g, bl in zip(("dq", "dk", "dv"), grads, gg, bb):
        assert_close_to_golden(name, a, g, bl, factor=3.0, reduction=red[name])


def test_nsa_compress_and_grad_cumulative_lengths():
    # §8.1 "Output [sum_b n_b, N, D], n_b = (s_b - l)//stride + 1 if s_b >= l, else 0"; grad comes first
    x, w = randn(90, 2, 16, dtype=F16, seed=48), randn(32, 2, dtype=F16, seed=49, scale=0.2)
    out = torch_npu.npu_nsa_compress(x, w, 32, 16, actual_seq_len=[20, 70, 90])  # lengths 20, 50, 20
    assert out.shape == (0 + 2 + 0, 2, 16)
    assert_close_to_golden("out", out, golden_nsa.nsa_compress(x, w, 32, 16, [20, 70, 90]),
                           golden_nsa.nsa_compress(x, w, 32, 16, [20, 70, 90], dtype=F16), reduction=32)
    dy = randn(*out.shape, dtype=F16, seed=50)
    gx, gw = torch_npu.npu_nsa_compress_grad(dy, x, w, 32, 16, actual_seq_len=[20, 70, 90])
    g = golden_nsa.nsa_compress_backward(dy, x, w, 32, 16, [20, 70, 90])
    bl = golden_nsa.nsa_compress_backward(dy, x, w, 32, 16, [20, 70, 90], dtype=F16)
    assert gx.shape == x.shape and gw.shape == w.shape
    assert_close_to_golden("input_grad", gx, g[0], bl[0], factor=3.0, reduction=2)  # in two compressed rows
    # a weight's gradient sums over every compressed row and the head dim
    assert_close_to_golden("weight_grad", gw, g[1], bl[1], factor=3.0, reduction=out.shape[0] * x.shape[-1])
