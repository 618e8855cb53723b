"""sparse_flash_mla forward against the fp64 golden: each branch alone and combined, every layout pair, sinks,
ratios, mask modes, padding, rows without keys, malformed index rows, low precision (the tolerance rule) and the
memory bound."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnops
from attnops.ops.dsv4 import reference
from attnops.testing import golden_dsv4 as G
from attnops.testing.compare import assert_close_to_golden

from .helpers import LAYOUT_PAIRS, Case, call, expected, hca, make_parts, pack, reductions, rows_of

BRANCHES = {
    "swa": lambda **kw: Case([5, 9], [12, 9], **kw),
    "hca": lambda **kw: hca([5, 9], [13, 9], **kw),
    "csa": lambda **kw: hca([5, 9], [13, 9], topk=3, **kw),
}


def check(case: Case, layout_q="BSND", layout_kv="BSND", tol=1e-12, **pack_kw):
    parts = make_parts(case)
    kw, starts = pack(case, parts, layout_q, layout_kv, **pack_kw)
    out, lse = rows_of(*call(kw))
    want_out, want_lse = expected(case, parts, starts, out.shape[0])
    torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=0)
    return out, lse


def test_golden_is_softmax_attention_without_masks_or_sinks():
    """Mode 0 without sinks: plain softmax attention with K = V (SDPA)."""
    q, kv = torch.randn(6, 2, 8, dtype=torch.float64), torch.randn(9, 8, dtype=torch.float64)
    out, lse = G.sparse_flash_mla(q, kv, None, None, None, 0.3, ori_mask_mode=0)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kv[None], kv[None], scale=0.3)
    torch.testing.assert_close(out, ref.transpose(0, 1))
    torch.testing.assert_close(lse, torch.logsumexp(0.3 * q @ kv.T, -1))


def test_golden_sink_is_a_null_key():
    """A sink is a key of logit ``sink`` with a zero value."""
    q, kv, sinks = torch.randn(4, 2, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64), torch.randn(2)
    out, lse = G.sparse_flash_mla(q, kv, None, None, sinks, 0.5, ori_mask_mode=0)
    logits = torch.cat([0.5 * q @ kv.T, sinks.double()[None, :, None].expand(4, 2, 1)], -1)
    torch.testing.assert_close(out, torch.softmax(logits, -1)[..., :5] @ kv)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1))


@pytest.mark.parametrize("sinks", [True, False])
@pytest.mark.parametrize("layouts", LAYOUT_PAIRS, ids=lambda p: "/".join(p))
@pytest.mark.parametrize("branch", list(BRANCHES))
def test_branches_layouts_sinks(branch, layouts, sinks):
    check(BRANCHES[branch](sinks=sinks), *layouts)


@pytest.mark.parametrize("layouts", LAYOUT_PAIRS, ids=lambda p: "/".join(p))
def test_padding_rows_are_zero(layouts):
    """Rows past ``seqused_q`` (and TND rows past the last prefix sum) give zeros."""
    out, lse = check(BRANCHES["csa"](), *layouts, pad_q=3)
    assert out.shape[0] > 14


def test_hca_alone_and_combined_each_branch_counts():
    """The compressed branch changes the result (it is not dropped) and shares the window's softmax."""
    case = hca([8], [16], ratio=2)
    parts = make_parts(case)
    kw, _ = pack(case, parts, "BSND", "BSND")
    with_cmp = call(kw).attn_out
    kw.pop("cmp_kv"), kw.pop("seqused_cmp_kv")
    assert not torch.allclose(with_cmp, call(kw).attn_out)


@pytest.mark.parametrize("ratio", [1, 2, 3, 4, 16, 128])
@pytest.mark.parametrize("topk", [None, 4])
def test_every_ratio(ratio, topk):
    ori = [2 * ratio + 3, ratio + 1]
    check(hca([min(6, n) for n in ori], ori, ratio=ratio, topk=topk, dim=4, heads=2,
              masks=dict(ori_mask_mode=4, ori_win_left=3, ori_win_right=0, cmp_mask_mode=3)), "TND", "PA_BBND",
          block_size=8)


@pytest.mark.parametrize("masks", [
    dict(ori_mask_mode=0, cmp_mask_mode=0),
    dict(ori_mask_mode=3, ori_win_right=0, cmp_mask_mode=3),
    dict(ori_mask_mode=3, ori_win_right=-1, cmp_mask_mode=0),
    dict(ori_mask_mode=4, ori_win_left=-1, ori_win_right=0),
    dict(ori_mask_mode=4, ori_win_left=2, ori_win_right=2),
    dict(ori_mask_mode=4, ori_win_left=0, ori_win_right=-1),
    dict(ori_mask_mode=4, ori_win_left=127, ori_win_right=0),
], ids=str)
@pytest.mark.parametrize("topk", [None, 3])
def test_mask_modes_and_windows(masks, topk):
    check(hca([7, 4], [14, 11], topk=topk, masks=masks), "BSND", "PA_BBND")


def test_rows_without_keys_are_zero_even_with_sinks():
    """``Lq > Lori``: rows at ``p < 0`` see no key (0 and lse 0); a batch with no ori key at all; a compressed
    branch whose rows see nothing yet (all -1)."""
    case = hca([6, 3, 4], [3, 0, 2], ratio=2, topk=2)
    out, lse = check(case, "TND", "TND")
    assert out[:3].abs().sum() == 0 and lse[:3].abs().sum() == 0 and lse[3].abs().sum() > 0
    assert out[6:9].abs().sum() == 0 and lse[6:9].abs().sum() == 0


def test_malformed_index_rows_follow_the_golden_rule():
    """-1 in the middle stops the row, entries past the visible count are skipped, only the first ``min(K, thr)``
    entries are read, duplicates count twice."""
    case = hca([4], [16], ratio=2, topk=6)
    parts = make_parts(case)
    parts.rows = [[[0, -1, 1, 2, 2, 2], [3, 0, 0, 7, 1, -1], [1, 7, 0, 0, 0, 0], [6, 6, 5, 4, 3, 2]]]
    kw, starts = pack(case, parts, "BSND", "BSND")
    out, lse = rows_of(*call(kw))
    want_out, want_lse = expected(case, parts, starts, out.shape[0])
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=0)
    dup = [[[0, -1, 1, 2, 2, 2], [3, 0, 0, 7, 1, -1], [1, 7, 0, 0, 0, 0], [6, 5, 4, 3, 2, 1]]]
    parts.rows = dup
    kw, _ = pack(case, parts, "BSND", "BSND")
    assert not torch.allclose(call(kw).attn_out[0, 3], out[3])  # the duplicate 6 counted twice before


def test_residual_sets_the_compressed_mask_length():
    """``Lcm = Lcmp * r + residual``; a residual that disagrees with ``Lori`` moves the compressed prefix."""
    case = Case([6], [17], cmp_lens=[4], residual=[3], ratio=4)
    check(case)
    case.residual = [0]
    check(case)
    case.residual = None  # the mask counts from Lori
    check(case)


def test_paged_compressed_length_derived_from_ori():
    """A paged cache without ``seqused_cmp_kv``: ``Lcmp = (Lori - residual) // r``."""
    check(hca([5, 9], [13, 9], topk=2), "TND", "PA_BBND", derive_cmp_len=True)


def test_scale_default_is_inverse_sqrt_head_dim():
    case = BRANCHES["hca"]()
    parts = make_parts(case)
    kw, _ = pack(case, parts, "BSND", "BSND")
    explicit = call(kw).attn_out
    kw["scale"] = None
    case.scale = case.dim ** -0.5
    kw2, _ = pack(case, parts, "BSND", "BSND")
    torch.testing.assert_close(call({**kw2, "scale": None}).attn_out, call(kw2).attn_out, rtol=0, atol=0)
    assert not torch.allclose(explicit, call(kw2).attn_out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("branch", list(BRANCHES))
def test_low_precision_tolerance_rule(branch, dtype):
    """The tolerance rule: error against the fp64 golden at most 2x that of the golden computed in ``dtype``."""
    case = BRANCHES[branch](dtype=dtype, dim=32, heads=4)
    parts = make_parts(case)
    kw, starts = pack(case, parts, "TND", "PA_BBND")
    out, lse = rows_of(*call(kw))
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = expected(case, parts, starts, out.shape[0])
    low_out, low_lse = expected(case, parts, starts, out.shape[0], dtype=dtype)
    red = reductions(case, parts)
    assert_close_to_golden("attn_out", out, ref_out, low_out, reduction=red["attn_out"])
    assert_close_to_golden("softmax_lse", lse, ref_lse, low_lse, reduction=red["softmax_lse"])


def test_chunks_give_the_same_result(monkeypatch):
    """Many small chunks (one row each) give the same rows as one chunk per batch."""
    case = hca([9, 13], [13, 17], ratio=2, topk=4, masks=dict(ori_mask_mode=3, ori_win_right=0, cmp_mask_mode=3))
    parts = make_parts(case)
    kw, _ = pack(case, parts, "TND", "PA_BBND")
    whole = call(kw)
    monkeypatch.setattr(reference, "BUDGET_BYTES", 1)
    torch.testing.assert_close(call(kw), whole, rtol=0, atol=1e-14)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("topk", [None, 64])
def test_memory_is_linear_in_the_sequence(monkeypatch, topk):
    """Causal ori keys and every compressed key (the widest rows): no tensor near ``[S, S]`` or ``[S, S/4]``."""
    s, heads, dim = 2048, 1, 8
    monkeypatch.setattr(reference, "BUDGET_BYTES", 1 << 20)
    q, kv = torch.randn(1, s, heads, dim), torch.randn(1, s, 1, dim)
    cmp = torch.randn(1, s // 4, 1, dim)
    idx = None if topk is None else torch.randint(0, 4, (1, s, 1, topk), dtype=torch.int32)
    with _LargestTensor() as mode:
        attnops.sparse_flash_mla(q, kv, cmp_kv=cmp, cmp_sparse_indices=idx, cmp_ratio=4, ori_mask_mode=3)
    assert mode.largest < s * s // 16, mode.largest


def _noncontig(x: torch.Tensor) -> torch.Tensor:
    perm = list(range(x.dim()))[::-1]
    return x.permute(perm).contiguous().permute(perm)


@pytest.mark.parametrize("layouts", [("BSND", "BSND"), ("TND", "PA_BBND")], ids=lambda p: "/".join(p))
def test_non_contiguous_inputs(layouts):
    case = BRANCHES["csa"]()
    kw, _ = pack(case, make_parts(case), *layouts)
    ref = call(kw)
    strided = {k: _noncontig(v) if isinstance(v, torch.Tensor) and v.dim() > 1 else v for k, v in kw.items()}
    assert not strided["q"].is_contiguous() and not strided["ori_kv"].is_contiguous()
    torch.testing.assert_close(call(strided), ref, rtol=0, atol=1e-14)
