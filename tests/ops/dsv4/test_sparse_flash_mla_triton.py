"""sparse_flash_mla's Triton forward kernels (``ATTNOPS_BACKEND=triton``) against the fp64 golden under the tolerance
rule: each branch in every layout pair, sinks, mask modes, padding, rows without keys, malformed index rows, the
residual and derived compressed lengths, the decode split and its deterministic combine. CUDA when there is a GPU,
else Triton's CPU interpreter (fp16/fp32, tiny shapes). Each test checks which kernels ran (a silent fallback to the
reference fails)."""
from __future__ import annotations

import pytest
import torch

import attnops

from attnops.testing.compare import assert_close_to_golden
from tests.triton_backend import DEVICE, triton_backend  # noqa: F401  (the fixture)

from .helpers import LAYOUT_PAIRS, Case, call, expected, hca, make_parts, pack, reductions, rows_of

pytest.importorskip("triton")

PREFILL = ["sparse_flash_mla_kernel"]
DECODE = ["sparse_flash_mla_split_kernel", "sparse_flash_mla_combine_kernel"]
F, H = torch.float32, torch.float16
BRANCHES = {
    "swa": lambda **kw: Case([5, 9], [12, 9], **kw),
    "hca": lambda **kw: hca([5, 9], [13, 9], **kw),
    "csa": lambda **kw: hca([5, 9], [13, 9], topk=3, **kw),
}


def _on_device(kw: dict) -> dict:
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def check(case: Case, layout_q="BSND", layout_kv="BSND", **pack_kw):
    """The kernels' ``(out, lse)`` rows, checked against the fp64 golden (the baseline: the golden in the case's
    dtype)."""
    parts = make_parts(case)
    kw, starts = pack(case, parts, layout_q, layout_kv, **pack_kw)
    out, lse = rows_of(*call(_on_device(kw)))
    out, lse = out.cpu(), lse.cpu()
    assert out.dtype == case.dtype and lse.dtype == torch.float32
    want_out, want_lse = expected(case, parts, starts, out.shape[0])
    low_out, low_lse = expected(case, parts, starts, out.shape[0], dtype=case.dtype)
    red = reductions(case, parts)
    assert_close_to_golden("attn_out", out, want_out, low_out, reduction=red["attn_out"])
    assert_close_to_golden("softmax_lse", lse, want_lse, low_lse, reduction=red["softmax_lse"])
    return out, lse


@pytest.mark.parametrize("layouts", LAYOUT_PAIRS, ids=lambda p: "/".join(p))
@pytest.mark.parametrize("branch", list(BRANCHES))
def test_branches_and_layouts(triton_backend, branch, layouts):
    check(BRANCHES[branch](dtype=F), *layouts)
    assert triton_backend == PREFILL


@pytest.mark.parametrize("branch", list(BRANCHES))
def test_fp16_wide_heads_split_columns(triton_backend, branch):
    """fp16, 48 head dims (two 32-column tiles in the interpreter: the value columns loaded apart from the keys),
    no sinks."""
    check(BRANCHES[branch](dtype=H, dim=48, heads=5, sinks=False), "TND", "PA_BBND")
    assert triton_backend == PREFILL


def test_head_tiles(triton_backend):
    """More heads than one program holds (16 in the interpreter): two head tiles, the second partly padding."""
    check(BRANCHES["csa"](dtype=F, heads=20), "TND", "TND")


MASKS = [dict(ori_mask_mode=0, cmp_mask_mode=0),
         dict(ori_mask_mode=3, ori_win_right=0, cmp_mask_mode=3),
         dict(ori_mask_mode=3, ori_win_right=-1, cmp_mask_mode=0),
         dict(ori_mask_mode=4, ori_win_left=-1),
         dict(ori_mask_mode=4, ori_win_left=2, ori_win_right=2),
         dict(ori_mask_mode=4, ori_win_left=0, ori_win_right=-1)]


@pytest.mark.parametrize("masks", [pytest.param(m, marks=() if i in (0, 4) else pytest.mark.slow)
                                   for i, m in enumerate(MASKS)], ids=str)
def test_mask_modes_and_windows(triton_backend, masks):
    check(hca([7, 4], [14, 11], topk=3, masks=masks, dtype=F), "BSND", "PA_BBND")


def test_padding_and_rows_without_keys_are_zero(triton_backend):
    """``Lq > Lori`` (rows before the first key), a batch without keys, compressed rows that see nothing yet, and
    padding rows past the last prefix sum: 0 in both outputs, sinks or not."""
    out, lse = check(hca([6, 3, 4], [3, 0, 2], ratio=2, topk=2, dtype=F), "TND", "TND", pad_q=2)
    assert out[:3].abs().sum() == 0 and lse[:3].abs().sum() == 0 and lse[3].abs().sum() > 0
    assert out[6:9].abs().sum() == 0 and lse[6:9].abs().sum() == 0 and lse[13:].abs().sum() == 0


def test_bsnd_padding_rows_past_seqused_q(triton_backend):
    out, lse = check(BRANCHES["csa"](dtype=F), "BSND", "BSND", pad_q=3)
    assert out.shape[0] == 24 and out[9:12].abs().sum() == 0 and lse[9:12].abs().sum() == 0


def test_malformed_index_rows_follow_the_golden_rule(triton_backend):
    """-1 in the middle stops the row, entries past the visible count are skipped, only the first ``min(K, thr)``
    entries are read, duplicates count twice."""
    case = hca([4], [16], ratio=2, topk=6, dtype=F)
    parts = make_parts(case)
    parts.rows = [[[0, -1, 1, 2, 2, 2], [3, 0, 0, 7, 1, -1], [1, 7, 0, 0, 0, 0], [6, 6, 5, 4, 3, 2]]]
    case.rows = parts.rows
    check(case)


def test_residual_and_derived_compressed_lengths(triton_backend):
    """``Lcm = Lcmp * r + residual`` (a residual that disagrees with ``Lori`` moves the compressed prefix); a paged
    cache without ``seqused_cmp_kv`` derives ``Lcmp = (Lori - residual) // r``."""
    check(Case([6], [17], cmp_lens=[4], residual=[3], ratio=4, dtype=F))
    check(Case([6], [17], cmp_lens=[4], residual=None, ratio=4, dtype=F))
    check(hca([5, 9], [13, 9], topk=2, dtype=F), "TND", "PA_BBND", derive_cmp_len=True)


WIDE_WINDOW = dict(ori_mask_mode=4, ori_win_left=40, ori_win_right=0, cmp_mask_mode=3)


@pytest.mark.parametrize("topk", [None, 8])
def test_decode_splits_each_row_and_combines(triton_backend, topk):
    """One token per request over a long window and many compressed keys: each row's key stream is split over
    programs, then combined in split order (twice the same bits)."""
    case = hca([1, 1, 1], [70, 45, 2], ratio=2, topk=topk, dtype=F, masks=WIDE_WINDOW)
    out, lse = check(case, "TND", "PA_BBND")
    assert triton_backend == DECODE
    again = rows_of(*call(_on_device(pack(case, make_parts(case), "TND", "PA_BBND")[0])))
    assert torch.equal(again[0].cpu(), out) and torch.equal(again[1].cpu(), lse)


@pytest.mark.slow
@pytest.mark.parametrize("layouts", LAYOUT_PAIRS, ids=lambda p: "/".join(p))
def test_fp16_decode_every_layout(triton_backend, layouts):
    check(hca([1, 1], [60, 37], ratio=4, topk=8, dtype=H, dim=64, heads=4, masks=WIDE_WINDOW), *layouts)
    assert triton_backend == DECODE


def test_unvalidated_indices_select_no_key(triton_backend, monkeypatch):
    """Without validation (as on a GPU) an index past the batch's compressed keys selects no key (the golden skips
    it); with validation (the CPU's default) it raises naming ``cmp_sparse_indices``."""
    case = hca([4], [16], ratio=2, topk=4, dtype=F)
    case.rows = [[[0, 10 ** 6, 1, -1], [10 ** 6, 2, 0, -1], [1, 0, 10 ** 6, 2], [3, 2, 1, 0]]]
    with pytest.raises(attnops.AclnnError, match="^cmp_sparse_indices"):
        check(case)
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
    check(case)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on -inf scores
@pytest.mark.parametrize("sinks", [False, True])
def test_rows_whose_scores_are_all_minus_infinity(triton_backend, monkeypatch, sinks):
    """Keys seen, every score -inf: the CPU reference's result (without a sink ``0 / 0``: a NaN output and lse -inf;
    with one, lse is the sink and the output ``0 * key``: NaN in the -inf column), not a row without keys."""
    case = Case([3], [3], heads=2, dim=16, dtype=F, sinks=sinks, masks=dict(ori_mask_mode=0, cmp_mask_mode=0))
    parts = make_parts(case)
    parts.qs[0] = parts.qs[0].abs()
    parts.oris[0][:, 0] = float("-inf")
    parts.oris[0][:, 1:] = 0.0
    kw, _ = pack(case, parts, "BSND", "BSND")
    got = [x.cpu() for x in rows_of(*call(_on_device(kw)))]
    monkeypatch.setenv("ATTNOPS_BACKEND", "reference")
    want = rows_of(*call(kw))
    assert got[0][..., 0].isnan().all() and bool(got[0].isnan().all()) != sinks
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, equal_nan=True, rtol=0, atol=0)
