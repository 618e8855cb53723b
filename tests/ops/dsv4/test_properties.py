"""Hypothesis property tests: random small sparse flash MLA calls (branches, layouts, lengths, ratios, masks,
windows, residuals, index rows well formed or not, sinks) in fp64 against the golden, forward and gradients."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .helpers import LAYOUT_PAIRS, Case, call, expected, grads_and_golden, make_parts, pack, rows_of

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    batches = draw(st.integers(1, 3))
    q_lens = [draw(st.integers(0, 7)) for _ in range(batches)]
    ori_lens = [draw(st.integers(0, 14)) for _ in range(batches)]
    ratio = draw(st.integers(1, 6))
    branch = draw(st.sampled_from(["swa", "hca", "csa"]))
    cmp_lens = residual = rows = topk = None
    if branch != "swa":
        if draw(st.booleans()):  # a consistent cache
            cmp_lens, residual = [n // ratio for n in ori_lens], [n % ratio for n in ori_lens]
        else:
            cmp_lens = [draw(st.integers(0, 5)) for _ in range(batches)]
            residual = draw(st.one_of(st.none(), st.lists(st.integers(0, ratio - 1), min_size=batches,
                                                          max_size=batches)))
    if branch == "csa":
        topk = draw(st.integers(1, 5))
        rows = [[[draw(st.integers(-1, max(lc - 1, -1))) for _ in range(topk)] for _ in range(lq)]
                for lq, lc in zip(q_lens, cmp_lens)] if draw(st.booleans()) else None
    masks = dict(ori_mask_mode=draw(st.sampled_from([0, 3, 4])), ori_win_left=draw(st.integers(-1, 5)),
                 ori_win_right=draw(st.integers(-1, 2)), cmp_mask_mode=draw(st.sampled_from([0, 3])))
    case = Case(q_lens, ori_lens, cmp_lens, residual, heads=draw(st.sampled_from([1, 2, 4])),
                dim=draw(st.sampled_from([2, 4, 8])), ratio=ratio, topk=topk, sinks=draw(st.booleans()),
                scale=draw(st.sampled_from([0.3, 1.0])), masks=masks, seed=draw(st.integers(0, 1000)), rows=rows)
    return case, draw(st.sampled_from(LAYOUT_PAIRS)), draw(st.sampled_from([1, 2, 4, 16]))


@SETTINGS
@given(cases())
def test_random_calls_match_the_golden(drawn):
    case, layouts, block_size = drawn
    if max(case.q_lens) == 0:
        case.q_lens[0] = 1
        if case.rows is not None:
            case.rows[0] = [[-1] * case.topk]
    parts = make_parts(case)
    kw, starts = pack(case, parts, *layouts, block_size=block_size)
    out, lse = rows_of(*call(kw))
    want_out, want_lse = expected(case, parts, starts, out.shape[0])
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=0)
    got, want = grads_and_golden(case, layouts, block_size=block_size)
    for name in got:
        torch.testing.assert_close(got[name], want[name], atol=1e-11, rtol=0, msg=name)
