"""Shared helpers of the NSA tests: inputs, and the checks of each operator against the fp64 golden.

Every check runs the operator (Pythonic API or aclnn dialect), the golden of ``attnops.testing.golden_nsa`` in
float64 and the same golden in the input dtype (the baseline), and judges each output with FlashAttention's
tolerance rule (``attnops.testing.compare``): factor 2 for forward outputs, 3 for gradients. The goldens get
copies of the inputs taken before the call.
"""
from __future__ import annotations

import torch

import attnops
import attnops.aclnn as aclnn
from attnops.testing import golden_nsa as G
from attnops.testing.compare import assert_close_to_golden, attention_reductions
from tests.helpers import cum  # noqa: F401  (re-exported to the NSA tests)

F64 = torch.float64
LOW = (torch.float16, torch.bfloat16, torch.float32)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    """Deterministic normal samples (drawn in float64, then cast)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dtype)


def baseline_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the tolerance rule's baseline: the input dtype (fp32 for fp64 inputs)."""
    return torch.float32 if dtype == F64 else dtype


def _c(x):
    """A CPU copy for the golden (the operator may run on another device)."""
    return None if x is None else x.detach().cpu().clone()


def nsa_reductions(q, k, v, q_lens, keys_per_row: int, topk=None) -> dict[str, int]:
    """:func:`attention_reductions` of TND attention whose rows attend at most ``keys_per_row`` keys; a key's
    gradient sums over the query rows of its whole GQA group, as often as a row repeats a block of ``topk``."""
    group = q.shape[1] // k.shape[1]
    repeats = 1 if topk is None or topk.numel() == 0 else int((topk.unsqueeze(-1) == topk.unsqueeze(-2)).sum(-1).max())
    return attention_reductions(q.shape[-1], v.shape[-1], max(max(q_lens, default=1), 1) * group * repeats,
                                max(keys_per_row, 1))


# ----------------------------------------------------------------------------------------------- compress
def check_compress(x, w, block, stride, act_seq_len, *, via="api", backward=True, seed=7, dy=None):
    """Forward (and backward) of compression vs the golden. ``act_seq_len`` is cumulative (leading 0 allowed)."""
    gx, gw = _c(x), _c(w)
    bdt = baseline_dtype(x.dtype)
    golden = G.nsa_compress(gx, gw, block, stride, act_seq_len)
    base = G.nsa_compress(gx, gw, block, stride, act_seq_len, dtype=bdt)
    dy = randn(*golden.shape, dtype=x.dtype, seed=seed) if dy is None else dy
    if via == "api":
        xx, ww = x.detach().clone().requires_grad_(backward), w.detach().clone().requires_grad_(backward)
        out = attnops.nsa_compress(xx, ww, block_size=block, stride=stride, actual_seq_len=act_seq_len)
    else:
        out = aclnn.nsa_compress(x, w, act_seq_len, "TND", block, stride, 0)
    assert out.shape == golden.shape and out.dtype == x.dtype
    assert_close_to_golden("nsa_compress.out", out, golden, base, factor=2, reduction=block)
    if not backward:
        return out
    gi, gwg = G.nsa_compress_backward(dy, gx, gw, block, stride, act_seq_len)
    bi, bwg = G.nsa_compress_backward(dy, gx, gw, block, stride, act_seq_len, dtype=bdt)
    if via == "api":
        if out.numel():
            out.backward(dy)
        di = xx.grad if xx.grad is not None else torch.zeros_like(x)
        dw = ww.grad if ww.grad is not None else torch.zeros_like(w)
    else:
        di, dw = aclnn.nsa_compress_grad(dy, x, w, act_seq_len, block, stride, 0, "TND")
    assert di.shape == x.shape and dw.shape == w.shape and di.dtype == x.dtype and dw.dtype == w.dtype
    overlaps = -(-block // stride)  # the compressed rows one token belongs to
    assert_close_to_golden("nsa_compress.input_grad", di, gi, bi, factor=3, reduction=overlaps)
    # a weight's gradient sums over every compressed row and the head dim
    assert_close_to_golden("nsa_compress.weight_grad", dw, gwg, bwg, factor=3,
                           reduction=max(1, golden.shape[0] * x.shape[-1]))
    return out


# ----------------------------------------------------------------------------------------------- selected
def random_topk(q_lens, kv_lens, n2, count, block, *, seed=0, distinct=True, extra_tokens=0):
    """``[T1, N2, count]`` int32 block indices local to each batch (distinct per row unless ``distinct=False``)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for sq, skv in zip(q_lens, kv_lens):
        nblk = skv // block
        for _ in range(sq):
            if distinct:
                rows.append(torch.stack([torch.randperm(nblk, generator=g)[:count] for _ in range(n2)]))
            else:
                rows.append(torch.randint(0, nblk, (n2, count), generator=g))
    rows += [torch.zeros(n2, count, dtype=torch.int64)] * extra_tokens
    return torch.stack(rows).to(torch.int32) if rows else torch.zeros(0, n2, count, dtype=torch.int32)


def check_selected(q, k, v, topk, *, block, q_lens, kv_lens, causal, scale=None, via="api", backward=True,
                   seed=11, q_cum=None, kv_cum=None, dy=None):
    """Forward (out, softmax_max, softmax_sum) and backward (dq, dk, dv) of selected attention vs the golden."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qc = cum(q_lens) if q_cum is None else q_cum
    kc = cum(kv_lens) if kv_cum is None else kv_cum
    count = topk.shape[-1]
    gq, gk, gv, gt = _c(q), _c(k), _c(v), _c(topk)
    bdt = baseline_dtype(q.dtype)
    g_out, g_max, g_sum = G.nsa_selected_attention(gq, gk, gv, gt, scale, block, qc, kc, causal)
    b_out, b_max, b_sum = G.nsa_selected_attention(gq, gk, gv, gt, scale, block, qc, kc, causal, dtype=bdt)
    dy = randn(*g_out.shape, dtype=q.dtype, seed=seed) if dy is None else dy
    if via == "api":
        qq, kk, vv = (x.detach().clone().requires_grad_(backward) for x in (q, k, v))
        out, smax, ssum = attnops.nsa_selected_attention(qq, kk, vv, topk, select_block_size=block, causal=causal,
                                                         scale=scale, actual_seq_qlen=qc, actual_seq_kvlen=kc,
                                                         return_stats=True)
    else:
        mask = torch.ones(64, 64, dtype=torch.bool).triu(1) if causal else None
        smax, ssum, out = aclnn.nsa_selected_attention(q, k, v, topk, mask, qc, kc, scale, q.shape[1], "TND",
                                                       2 if causal else 0, block, count)
    assert out.shape == g_out.shape and out.dtype == q.dtype
    assert smax.shape == g_max.shape and smax.dtype == (F64 if q.dtype == F64 else torch.float32)
    red = nsa_reductions(q, k, v, q_lens, count * block, topk)  # a row attends its selected blocks' keys
    assert_close_to_golden("selected.out", out, g_out, b_out, factor=2, reduction=red["out"])
    assert_close_to_golden("selected.softmax_max", smax, g_max, b_max, factor=2, reduction=red["softmax_max"])
    assert_close_to_golden("selected.softmax_sum", ssum, g_sum, b_sum, factor=2, reduction=red["softmax_sum"])
    res = dict(out=out, smax=smax, ssum=ssum, golden=(g_out, g_max, g_sum))
    if not backward:
        return res
    given = _c(out.detach())  # the grad operator forms D = rowsum(dy * out) from the output it is given
    g = G.nsa_selected_attention_backward(dy, gq, gk, gv, gt, scale, block, qc, kc, causal, attention_in=given)
    b = G.nsa_selected_attention_backward(dy, gq, gk, gv, gt, scale, block, qc, kc, causal, dtype=bdt,
                                          attention_in=given)
    if via == "api":
        out.backward(dy)
        grads = (qq.grad, kk.grad, vv.grad)
    else:
        mask = torch.ones(64, 64, dtype=torch.bool).triu(1) if causal else None
        grads = aclnn.nsa_selected_attention_grad(q, k, v, out, dy, smax, ssum, topk, qc, kc, mask, scale, block,
                                                  count, q.shape[1], "TND", 2 if causal else 0)
    for name, a, gg, bb, like in zip(("dq", "dk", "dv"), grads, g, b, (q, k, v)):
        assert a.shape == like.shape and a.dtype == like.dtype, name
        assert_close_to_golden(f"selected.{name}", a, gg, bb, factor=3, reduction=red[name])
    res.update(grads=grads, golden_grads=g)
    return res


# ----------------------------------------------------------------------------------------------- compress attention
def sel_cum(cmp_lens, select_block, stride) -> list[int]:
    m = select_block // stride
    return cum([-(-n // m) for n in cmp_lens])


def causal_cmp_mask(q_lens, cmp_lens, block, stride, offset=0) -> torch.Tensor:
    """``[maxSq, maxCmp]`` (True = masked): compressed block c visible to token i (at position ``offset + i``) once
    complete."""
    ends = torch.arange(max(cmp_lens)) * stride + block - 1
    return ends.unsqueeze(0) > torch.arange(max(q_lens)).unsqueeze(1) + offset


def assert_topk(actual, golden, scores, q_lens, *, exact=True, sep=1e-5, tol=1e-5, qc=None):
    """Top-k indices vs the golden's.

    Always: every row holds distinct valid indices, and the golden scores of the chosen blocks equal (within
    ``tol``) those of the golden's choice, position by position (a swap of near-equal scores is allowed).
    ``exact``: the indices are equal, and the test premise is checked: in every row the top ``count + 1`` golden
    scores that differ are at least ``sep`` apart.
    """
    assert actual.dtype == torch.int32 and actual.shape == golden.shape, (actual.dtype, actual.shape, golden.shape)
    count = actual.shape[-1]
    starts = [0] + cum(q_lens)[:-1]
    for b, (start, sq) in enumerate(zip(starts, q_lens)):
        sc = scores[b]  # [Sq, N2, Sel] float64
        for i in range(sq):
            for h in range(actual.shape[1]):
                a = actual[start + i, h].tolist()
                e = golden[start + i, h].tolist()
                row = sc[i, h]
                assert len(set(a)) == count and all(0 <= x < row.numel() for x in a), (b, i, h, a)
                sa, se = row[a], row[e]
                same = (sa == se) | ((sa - se).abs() <= tol)
                assert bool(same.all()), f"batch {b} row {i} head {h}: got {a}, golden {e}, scores {row.tolist()}"
                if exact:
                    top = row.sort(descending=True).values[:count + 1]
                    gaps = (top[:-1] - top[1:])
                    gaps = gaps[(gaps > 0) & torch.isfinite(gaps)]
                    assert bool((gaps >= sep).all()), f"test premise: near-tie in batch {b} row {i}: {top.tolist()}"
                    assert a == e, f"batch {b} row {i} head {h}: got {a}, golden {e}, scores {row.tolist()}"


def local_forced_mask(q_lens, cmp_lens, select_block, stride, local_blocks, offset=0):
    """The NSA layer's ``[maxSq, maxSel]`` topk_mask: block 0 and the ``local_blocks`` blocks ending at the row's
    (row ``i`` at position ``offset + i``)."""
    own = ((torch.arange(max(q_lens)) + offset) // select_block).unsqueeze(1)
    cols = torch.arange(max(-(-c // (select_block // stride)) for c in cmp_lens)).unsqueeze(0)
    return (cols == 0) | ((cols <= own) & (cols > own - local_blocks))


def check_compress_attention(q, k, v, *, block, stride, select_block, count, q_lens, cmp_lens, atten_mask=None,
                             topk_mask=None, scale=None, via="api", backward=True, exact_topk=True, seed=13,
                             topk_tol=1e-5, causal=False, local_blocks=None, position_offset=0):
    """Outputs (out, stats, top-k) and gradients of compressed attention vs the golden (``causal``,
    ``local_blocks``: the operator computes the NSA causal mask and the layer's forced blocks, the golden reads them
    as dense masks; ``position_offset``: the position of every sequence's first row in both)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    golden_mask = causal_cmp_mask(q_lens, cmp_lens, block, stride, position_offset) if causal else atten_mask
    golden_forced = topk_mask if local_blocks is None else local_forced_mask(q_lens, cmp_lens, select_block, stride,
                                                                             local_blocks, position_offset)
    qc, cc, sc = cum(q_lens), cum(cmp_lens), sel_cum(cmp_lens, select_block, stride)
    n1 = q.shape[1]
    gq, gk, gv = _c(q), _c(k), _c(v)
    bdt = baseline_dtype(q.dtype)
    gargs = (scale, n1, block, stride, select_block, count, _c(golden_mask), _c(golden_forced), qc, cc, sc)
    g_out, g_topk, g_max, g_sum, g_scores = G.nsa_compress_attention(gq, gk, gv, *gargs, return_scores=True)
    b_out, _, b_max, b_sum = G.nsa_compress_attention(gq, gk, gv, *gargs, dtype=bdt)
    dy = randn(*g_out.shape, dtype=q.dtype, seed=seed)
    if via == "api":
        qq, kk, vv = (x.detach().clone().requires_grad_(backward) for x in (q, k, v))
        r = attnops.nsa_compress_attention(qq, kk, vv, compress_block_size=block, compress_stride=stride,
                                           select_block_size=select_block, select_block_count=count, scale=scale,
                                           atten_mask=atten_mask, topk_mask=topk_mask, causal=causal,
                                           local_blocks=local_blocks, position_offset=position_offset,
                                           actual_seq_qlen=qc, actual_cmp_seq_kvlen=cc)
        out, topk, smax, ssum = r.out, r.topk_indices, r.softmax_max, r.softmax_sum
    else:
        smax, ssum, out, topk = aclnn.nsa_compress_attention(q, k, v, atten_mask, topk_mask, qc, cc, sc, scale, n1,
                                                             "TND", 1 if atten_mask is not None else 0, block,
                                                             stride, select_block, count)
    assert out.shape == g_out.shape and out.dtype == q.dtype and out.device == q.device
    assert smax.shape == g_max.shape
    out, topk, smax, ssum = (t.cpu() for t in (out, topk, smax, ssum))
    red = nsa_reductions(q, k, v, q_lens, max(cmp_lens, default=1))
    assert_close_to_golden("compress_attention.out", out, g_out, b_out, factor=2, reduction=red["out"])
    assert_close_to_golden("compress_attention.softmax_max", smax, g_max, b_max, factor=2,
                           reduction=red["softmax_max"])
    assert_close_to_golden("compress_attention.softmax_sum", ssum, g_sum, b_sum, factor=2,
                           reduction=red["softmax_sum"])
    assert_topk(topk, g_topk, g_scores, q_lens, exact=exact_topk, tol=topk_tol)
    res = dict(out=out, topk=topk, smax=smax, ssum=ssum, golden_topk=g_topk, scores=g_scores)
    if backward:
        assert via == "api", "the aclnn dialect has no NsaCompressAttention grad"
        r.out.backward(dy.to(q.device))
        g = G.nsa_compress_attention_backward(dy, gq, gk, gv, *gargs)
        b = G.nsa_compress_attention_backward(dy, gq, gk, gv, *gargs, dtype=bdt)
        for name, a, gg, bb, like in zip(("dq", "dk", "dv"), (qq.grad, kk.grad, vv.grad), g, b, (q, k, v)):
            assert a.shape == like.shape and a.dtype == like.dtype, name
            assert_close_to_golden(f"compress_attention.{name}", a.cpu(), gg, bb, factor=3, reduction=red[name])
    return res
