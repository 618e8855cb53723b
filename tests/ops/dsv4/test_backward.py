"""sparse_flash_mla backward: gradients (q, ori_kv, cmp_kv, sinks; through out and lse) against autograd of the fp64
golden for each branch and layout pair, gradcheck, the grad function and its per-entry probabilities, low precision,
and bitwise repeatability."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.ops.dsv4 import reference
from attnops.testing.compare import assert_close_to_golden

from .helpers import (INPUTS, LAYOUT_PAIRS, Case, call, golden, golden_grads, grads_and_golden, hca, make_parts,
                      pack, reductions, weights)

BRANCHES = {
    "swa": lambda **kw: Case([5, 9], [12, 9], **kw),
    "hca": lambda **kw: hca([5, 9], [13, 9], **kw),
    "csa": lambda **kw: hca([5, 9], [13, 9], topk=3, **kw),
}
def _compare(got, want, tol=1e-12):
    for name in got:
        torch.testing.assert_close(got[name].double(), want[name].double(), atol=tol, rtol=0, msg=name)


@pytest.mark.parametrize("layouts", LAYOUT_PAIRS, ids=lambda p: "/".join(p))
@pytest.mark.parametrize("branch", list(BRANCHES))
def test_gradients_against_golden(branch, layouts):
    got, want = grads_and_golden(BRANCHES[branch](), layouts)
    assert set(got) == {"q", "ori_kv", "sinks"} | ({"cmp_kv"} if branch != "swa" else set())
    _compare(got, want)


@pytest.mark.parametrize("topk", [None, 3])
def test_gradients_padding_empty_rows_no_sinks(topk):
    """Padding rows, rows without keys (``Lq > Lori``) and a batch without keys give zero gradients there."""
    case = hca([6, 3, 4], [3, 0, 9], ratio=2, topk=topk, sinks=False)
    got, want = grads_and_golden(case, ("TND", "PA_BBND"), pad_q=2)
    _compare(got, want)
    assert got["q"][:3].abs().sum() == 0 and got["q"][-2:].abs().sum() == 0


def test_gradients_other_masks_and_malformed_rows():
    case = hca([4, 6], [16, 12], ratio=2, topk=5, masks=dict(ori_mask_mode=3, ori_win_right=1, cmp_mask_mode=0))
    case.rows = [[[0, -1, 1, 2, 2], [3, 0, 0, 7, 1], [1, 7, 0, 0, 0], [6, 6, 5, 4, 3]],
                 [[5, 4, 3, 2, 1], [5, 5, 5, -1, 0], [0, 1, 2, 3, 4], [-1, 1, 2, 3, 4], [2, 2, 2, 2, 2],
                  [1, 0, -1, -1, -1]]]
    got, want = grads_and_golden(case, ("BSND", "BSND"))
    _compare(got, want)


@pytest.mark.parametrize("branch", list(BRANCHES))
def test_gradcheck(branch):
    case = BRANCHES[branch](dim=4, heads=2)
    case.q_lens, case.ori_lens = [3, 4], [6, 5]
    if case.cmp_lens is not None:
        case.cmp_lens, case.residual = [3, 2], [0, 1]
    parts = make_parts(case)
    kw, _ = pack(case, parts, "TND", "PA_BBND")
    names = [n for n in INPUTS if n in kw]
    tensors = [kw[n].requires_grad_() for n in names]

    def fn(*xs):
        return call({**kw, **dict(zip(names, xs))})

    assert torch.autograd.gradcheck(fn, tensors, atol=1e-8)


def test_grad_function_matches_autograd_and_gives_entry_probabilities():
    case = BRANCHES["csa"]()
    parts = make_parts(case)
    kw, starts = pack(case, parts, "BSND", "BSND", requires_grad=True)
    out, lse = call(kw)
    w = weights(out.shape, 3)
    (out * w).sum().backward()
    plain = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    q, ori = plain.pop("q"), plain.pop("ori_kv")
    res = attnops.sparse_flash_mla_grad(q, ori, w, out.detach(), lse.detach(), **plain)
    torch.testing.assert_close(res.d_q, kw["q"].grad, rtol=0, atol=0)
    torch.testing.assert_close(res.d_ori_kv, kw["ori_kv"].grad, rtol=0, atol=0)
    torch.testing.assert_close(res.d_cmp_kv, kw["cmp_kv"].grad, rtol=0, atol=0)
    torch.testing.assert_close(res.d_sinks, kw["sinks"].grad, rtol=0, atol=0)
    assert res.ori_softmax_l1_norm is None
    l1 = res.cmp_softmax_l1_norm
    assert l1.shape == plain["cmp_sparse_indices"].shape and l1.dtype == torch.float64
    golden_lse = golden(case, parts)
    for b, s in enumerate(starts):
        for i, row in enumerate(parts.rows[b]):
            for e, c in enumerate(row):
                p = 0.0 if c < 0 else torch.exp(case.scale * parts.qs[b][i] @ parts.cmps[b][c] - golden_lse[b][1][i])
                assert abs(float(l1.view(-1, l1.shape[-1])[s + i, e]) - float(torch.as_tensor(p).sum())) < 1e-12


def test_grad_of_lse_only():
    """A loss of the lse alone (sinks included in it)."""
    case = BRANCHES["hca"]()
    parts = make_parts(case)
    kw, starts = pack(case, parts, "TND", "TND", requires_grad=True)
    call(kw).softmax_lse.sum().backward()
    sinks = parts.sinks.requires_grad_()
    sum(l.sum() for _, l in golden(case, parts)).backward()
    torch.testing.assert_close(kw["sinks"].grad, sinks.grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("branch", list(BRANCHES))
def test_low_precision_gradients(branch, dtype):
    """The tolerance rule: gradient error against the fp64 golden at most 3x that of the golden in ``dtype``."""
    case = BRANCHES[branch](dtype=dtype, dim=32, heads=4)
    got, want = grads_and_golden(case, ("TND", "PA_BBND"))
    low = golden_grads(case, ("TND", "PA_BBND"), dtype=dtype)
    red = reductions(case, make_parts(case))
    for name in got:
        assert_close_to_golden(name, got[name], want[name], low[name], factor=3.0, reduction=red[name])


def test_backward_is_bitwise_repeatable(monkeypatch):
    """Several chunks, duplicate indices, keys shared by many rows: two runs give identical bits."""
    monkeypatch.setattr(reference, "BUDGET_BYTES", 4096)
    case = hca([9, 13], [40, 17], ratio=2, topk=6, dtype=torch.float32, dim=16, heads=4)
    parts = make_parts(case)
    parts.rows = [[[r[0]] * 3 + r[3:] for r in rows] for rows in parts.rows]

    def run():
        kw, _ = pack(case, parts, "TND", "PA_BBND", requires_grad=True)
        out, lse = call(kw)
        (out.sum() + lse.sum()).backward()
        return [kw[n].grad for n in INPUTS]

    first, second = run(), run()
    for a, b in zip(first, second):
        assert torch.equal(a, b)
