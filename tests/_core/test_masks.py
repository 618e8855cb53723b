"""MaskSpec (the one mask normal form): col_range / masked_block / fill_masked_ agree with a dense construction,
and build_mask_spec turns every sparse mode into the keep sets of cann_semantics.md §1.1."""
import itertools

import pytest
import torch

from attnops import ParamInvalidError
from attnops._core.masks import INF, MaskSpec, build_mask_spec
from attnops._core.varlen import SeqInfo, seq_info_varlen

TRIU = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
_RECT = torch.zeros(1024, 2048, dtype=torch.bool)
_RECT[:, 1024:] = True
PREFIX = torch.cat([TRIU, _RECT])


def _dense_keep(lo, hi, prefix, explicit_b, sq, skv, heads):
    """keep[n, i, j] = (lo <= j-i <= hi or j < prefix) and not explicit[n, i, j], written directly."""
    keep = torch.zeros(heads, sq, skv, dtype=torch.bool)
    for n, i, j in itertools.product(range(heads), range(sq), range(skv)):
        band = lo <= j - i <= hi
        pre = prefix is not None and j < prefix
        masked = explicit_b is not None and bool(explicit_b[n if explicit_b.shape[0] > 1 else 0, i, j])
        keep[n, i, j] = (band or pre) and not masked
    return keep


SPECS = [  # (lo, hi, prefix, with explicit mask)
    (-INF, INF, None, False), (-INF, 0, None, False), (-2, 1, None, False), (-INF, 2, None, True),
    (1, 3, None, False), (-INF, -2, 3, False), (-3, -1, 2, True), (-1, INF, None, True), (2, INF, 4, False),
    (-INF, -9, None, False),  # nothing kept
]


@pytest.mark.parametrize("lo,hi,prefix,with_explicit", SPECS)
def test_tile_queries_agree_with_dense_construction(lo, hi, prefix, with_explicit):
    sq, skv, heads = 6, 8, 2
    g = torch.Generator().manual_seed(abs(lo) % 97 + hi % 89)
    explicit = torch.rand(1, heads, sq + 1, skv + 2, generator=g) < 0.3 if with_explicit else None
    spec = MaskSpec((lo,), (hi,), prefix=None if prefix is None else (prefix,), explicit=explicit)
    keep = _dense_keep(lo, hi, prefix, None if explicit is None else explicit[0], sq, skv, heads)
    keep_band = _dense_keep(lo, hi, prefix, None, sq, skv, 1)[0]
    for r0, r1 in [(0, sq), (0, 1), (2, 5), (5, 6)]:
        c0, c1 = spec.col_range(0, r0, r1, skv)
        assert 0 <= c0 and c1 <= skv
        # every column that the band/prefix keeps for these rows lies in [c0, c1)
        kept_cols = keep_band[r0:r1].any(0).nonzero().flatten().tolist()
        assert all(c0 <= j < c1 for j in kept_cols), (r0, r1, c0, c1, kept_cols)
        for a, b in [(0, skv), (c0, c1), (max(c0, 1), max(c0, 1) + 3)]:
            b = min(b, skv)
            if a >= b:
                continue
            want_masked = ~keep[:, r0:r1, a:b]
            got = spec.masked_block(0, r0, r1, a, b, heads=slice(0, heads))
            if got is None:
                assert not bool(want_masked.any())
            else:
                assert torch.equal(got.expand_as(want_masked), want_masked)
            tile = torch.zeros(heads, r1 - r0, b - a)
            spec.fill_masked_(tile, 0, r0, r1, a, b, heads=slice(0, heads))
            assert torch.equal(torch.isinf(tile), want_masked) and bool((tile[~want_masked] == 0).all())
            # keeps_every_row never claims a row that keeps nothing (an explicit mask: never claimed)
            if spec.keeps_every_row(0, r0, r1, a, b):
                assert bool(keep[:, r0:r1, a:b].any(-1).all()), (r0, r1, a, b)
            elif not with_explicit:
                assert not bool(keep_band[r0:r1, a:b].any(-1).all()), (r0, r1, a, b)


def test_full_spec():
    assert MaskSpec((-INF,), (INF,)).is_full
    assert not MaskSpec((-INF,), (0,)).is_full


def _keep_from_spec(spec, seq, b, heads=1):
    sq, skv = seq.q_lens[b], seq.kv_lens[b]
    m = spec.masked_block(b, 0, sq, 0, skv, heads=slice(0, heads))
    return torch.ones(heads, sq, skv, dtype=torch.bool) if m is None else ~m.expand(heads, sq, skv)


def _ij(sq, skv):
    return torch.arange(sq).view(-1, 1), torch.arange(skv).view(1, -1)


DENSE_MODES = (0, 1, 2, 3, 4, 5, 6)
TND_MODES = (0, 1, 2, 3, 4, 6, 7, 8)


@pytest.mark.parametrize("mode", [2, 3, 4, 6, 7, 8])
def test_build_mask_spec_compressed_modes_tnd(mode):
    q_lens, kv_lens = [0, 3, 5, 2, 0], [2, 5, 5, 6, 0]
    seq = seq_info_varlen(q_lens, kv_lens)
    pre, nxt = 6, -1
    prefix = [2, 3, 0, 4, 0]
    spec = build_mask_spec(sparse_mode=mode, atten_mask=PREFIX if mode == 6 else TRIU, pre_tokens=pre,
                           next_tokens=nxt, prefix=prefix, seq=seq, n1=2, allowed_modes=TND_MODES)
    band_b = {7: 3, 8: 1}.get(mode)  # last / first batch with Sq > 0
    for b, (sq, skv) in enumerate(zip(q_lens, kv_lens)):
        i, j = _ij(sq, skv)
        delta = skv - sq
        want = {2: j <= i, 3: j <= i + delta, 4: (j - i - delta >= -pre) & (j - i - delta <= nxt),
                6: (j <= i + delta) | (j < prefix[b]), 7: j <= i + delta, 8: j <= i}[mode]
        if b == band_b:
            want = (j - i - delta >= -pre) & (j - i - delta <= nxt)
        assert torch.equal(_keep_from_spec(spec, seq, b)[0], want), (mode, b)


@pytest.mark.parametrize("mode", [0, 1, 5])
def test_build_mask_spec_explicit_modes_dense(mode):
    seq = SeqInfo.dense(2, 4, 6)
    g = torch.Generator().manual_seed(mode)
    mask = torch.rand(2, 3, 4, 6, generator=g) < 0.3
    spec = build_mask_spec(sparse_mode=mode, atten_mask=mask.to(torch.uint8), pre_tokens=1, next_tokens=2,
                           prefix=[2, 5], seq=seq, n1=3, allowed_modes=DENSE_MODES)
    i, j = _ij(4, 6)
    for b in range(2):
        band = {0: (j - i >= -1) & (j - i <= 2), 1: torch.ones(4, 6, dtype=torch.bool),
                5: (j <= i + 2) | (j < [2, 5][b])}[mode]
        assert torch.equal(_keep_from_spec(spec, seq, b, heads=3), band & ~mask[b])


def test_no_mask_means_full_attention_whatever_the_mode():
    seq = SeqInfo.dense(1, 3, 3)
    for mode in DENSE_MODES:
        spec = build_mask_spec(sparse_mode=mode, atten_mask=None, pre_tokens=0, next_tokens=0, prefix=None, seq=seq,
                               n1=1, allowed_modes=DENSE_MODES)
        assert spec.is_full


@pytest.mark.parametrize("mode,mask,name", [
    (2, torch.ones(2048, 2048, dtype=torch.bool).triu(0), "atten_mask"),     # diagonal masked too
    (3, torch.ones(1024, 1024, dtype=torch.bool).triu(1), "atten_mask"),     # wrong size
    (4, TRIU.T.contiguous(), "atten_mask"),
    (6, TRIU, "atten_mask"),                                                 # mode 6 needs 3072 x 2048
    (6, torch.cat([TRIU, ~_RECT]), "atten_mask"),
    (7, TRIU.unsqueeze(0).repeat(2, 1, 1), "atten_mask"),                    # leading dims must be 1
    (5, torch.zeros(1, 1, 4, 4, dtype=torch.bool), "sparse_mode"),           # mode 5 is dense-only
    (9, TRIU, "sparse_mode"),
])
def test_build_mask_spec_rejects(mode, mask, name):
    seq = seq_info_varlen([4], [4])
    with pytest.raises(ParamInvalidError, match=f"^{name}"):
        build_mask_spec(sparse_mode=mode, atten_mask=mask, pre_tokens=4, next_tokens=0, prefix=[0], seq=seq, n1=1,
                        allowed_modes=TND_MODES)


def test_a_compressed_mask_found_canonical_is_checked_again_after_an_in_place_change():
    import attnops

    q = torch.randn(1, 1, 8, 4)
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    attnops.flash_attention(q, q, q, atten_mask=mask, sparse_mode=2)
    attnops.flash_attention(q, q, q, atten_mask=mask, sparse_mode=2)  # the cached verdict
    mask[0, 5] = False  # same tensor, new content: must be rejected
    with pytest.raises(ValueError, match="canonical compressed mask"):
        attnops.flash_attention(q, q, q, atten_mask=mask, sparse_mode=2)
    with torch.inference_mode():
        good = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
        attnops.flash_attention(q, q, q, atten_mask=good, sparse_mode=2)  # inference tensors: checked every time
        bad = good.clone()
        bad[3, 1] = True
        with pytest.raises(ValueError, match="canonical compressed mask"):
            attnops.flash_attention(q, q, q, atten_mask=bad, sparse_mode=2)
