"""The DeepSeek-V4 lightning indexer's Triton kernel through the public operator (``ATTNOPS_BACKEND=triton``) against
the fp64 golden: every layout pair, mask modes 0 and 3 with ``cmp_ratio`` and residuals, paged keys, ``seqused``,
index offsets, ties, top-k over several chunks, fp16. CUDA when there is a GPU, else Triton's CPU interpreter; each
test checks that the kernel ran (a silent fallback to the reference fails)."""
from __future__ import annotations

import pytest
import torch

from attnops.testing import golden_indexer_v2 as G
from tests.ops.dsv4.test_indexer_v2 import _case, _golden, _run
from tests.triton_backend import DEVICE, triton_backend  # noqa: F401  (the fixture)

pytest.importorskip("triton")

F, H = torch.float32, torch.float16


def _check_row(got: list[int], vals: list[float], scores: torch.Tensor, want: list[int], offset: int = 0) -> None:
    """Same count and -1 / -inf tail; indices equal to the golden's except between keys whose golden scores are
    within rounding of the boundary score (ties and near-ties may swap); values the golden scores of the indices."""
    n = sum(v >= 0 for v in want)
    assert all(v >= 0 for v in got[:n]) and all(v == -1 for v in got[n:]), (got, want)
    assert all(v == float("-inf") for v in vals[n:])
    if n == 0:
        return
    pos = [j - offset for j in got[:n]]
    boundary = float(scores[want[n - 1] - offset])
    tol = 1e-3 + 1e-3 * float(scores.abs().max())
    assert all(abs(float(scores[j - offset]) - boundary) <= tol for j in set(got[:n]) ^ set(want[:n])), (got, want)
    torch.testing.assert_close(torch.tensor(vals[:n], dtype=torch.float64), scores[pos], atol=tol, rtol=0)


def _check(got, qs, ks, ws, topk, *, mask_mode, cmp_ratio=1, residual=None, offsets=None):
    want = _golden(qs, ks, ws, topk, mask_mode=mask_mode, cmp_ratio=cmp_ratio, residual=residual, offsets=offsets)
    for b, ((idx, val, pad), (gidx, _)) in enumerate(zip(got, want)):
        scores = G.scores(qs[b], ks[b], ws[b])
        for i, row in enumerate(idx):
            _check_row(row, val[i], scores[i], gidx[i], 0 if offsets is None else offsets[b][i])
        assert all(v == -1 for r in pad for v in r)


CASES = [  # layout, layout_key, q_lens, k_lens, cmp_ratio, residual, mask_mode
    ("BSND", "BSND", [9, 5], [3, 2], 4, [2, 1], 3),
    ("TND", "TND", [9, 0, 6], [3, 2, 1], 4, [0, 3, 2], 3),
    ("TND", "PA_BBND", [9, 1, 6], [5, 4, 2], 4, [1, 0, 3], 3),
    ("BSND", "PA_BSND", [4, 3], [6, 3], 2, [1, 0], 3),
    ("TND", "TND", [5, 4], [7, 3], 1, None, 3),
    ("TND", "PA_BSND", [5, 4], [7, 3], 4, None, 0),
    ("BSND", "BSND", [3, 2], [2, 4], 128, [100, 5], 3),
]


@pytest.mark.parametrize("layout,layout_key,q_lens,k_lens,ratio,residual,mode", CASES)
def test_kernel_matches_golden(triton_backend, layout, layout_key, q_lens, k_lens, ratio, residual, mode):
    qs, ks, ws = _case(q_lens, k_lens, 3, 16, dtype=F, seed=len(q_lens) + ratio)
    got, res = _run(qs, ks, ws, 4, layout=layout, layout_key=layout_key, mask_mode=mode, cmp_ratio=ratio,
                    residual=residual, device=DEVICE)
    assert triton_backend == ["indexer_v2_kernel"]
    assert res.sparse_indices.dtype == torch.int32 and res.sparse_values.dtype == torch.float32
    _check(got, qs, ks, ws, 4, mask_mode=mode, cmp_ratio=ratio, residual=residual)


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_seqused_q_padding_rows_and_offsets(triton_backend, layout):
    qs, ks, ws = _case([3, 4], [4, 5], 2, 8, dtype=F, seed=3)
    offsets = [[100 + i for i in range(3)], [7 * i for i in range(4)]]
    got, _ = _run(qs, ks, ws, 3, layout=layout, layout_key=layout, residual=[1, 0], cmp_ratio=2, q_stored=[6, 5],
                  offsets=offsets, device=DEVICE)
    assert triton_backend == ["indexer_v2_kernel"]
    _check(got, qs, ks, ws, 3, mask_mode=3, cmp_ratio=2, residual=[1, 0], offsets=offsets)


def test_ties_go_to_the_lower_index(triton_backend):
    k = torch.tensor([[1.0, 0], [2, 0], [1, 0], [2, 0], [0, 1], [2, 0]])
    q = torch.tensor([[[1.0, 0]]]).expand(2, 1, 2).contiguous()
    got, _ = _run([q], [k], [torch.ones(2, 1)], 4, layout="TND", layout_key="TND", mask_mode=0, device=DEVICE)
    assert triton_backend == ["indexer_v2_kernel"]
    assert got[0][0] == [[1, 3, 5, 0], [1, 3, 5, 0]]
    assert got[0][1][0] == [2.0, 2.0, 2.0, 1.0]


@pytest.mark.parametrize("dtype,topk", [(F, 20), (H, 6)])
def test_top_k_over_several_chunks(triton_backend, dtype, topk):
    """40 keys: chunks of the top-k width merged into the running top-k (fp16: near-ties may swap at the cut)."""
    qs, ks, ws = _case([6, 3], [40, 17], 4, 16, dtype=dtype, seed=9)
    got, _ = _run(qs, ks, ws, topk, layout="TND", layout_key="PA_BSND", mask_mode=3, cmp_ratio=4, residual=[1, 3],
                  block_size=8, device=DEVICE)
    assert triton_backend == ["indexer_v2_kernel"]
    _check(got, qs, ks, ws, topk, mask_mode=3, cmp_ratio=4, residual=[1, 3])
