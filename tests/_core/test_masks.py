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


# ------------------------------------------------------------------------------------------ explicit bands


INT_MAX = 2**31 - 1


def _band(sq, skv, lo, hi):
    """Bool [sq, skv], True (masked) outside lo <= j - i <= hi."""
    diff = torch.arange(skv).unsqueeze(0) - torch.arange(sq).unsqueeze(1)
    return (diff < lo) | (diff > hi)


def _spec(mask, mode=0, q_lens=(6,), kv_lens=(8,), pre=INT_MAX, nxt=INT_MAX, n1=2):
    b = len(q_lens)
    seq = seq_info_varlen(list(q_lens), list(kv_lens)) if len(set(q_lens)) > 1 else SeqInfo(
        tuple(q_lens), tuple(kv_lens), tuple(q_lens[0] * i for i in range(b)), tuple(kv_lens[0] * i for i in range(b)),
        False)
    return build_mask_spec(sparse_mode=mode, atten_mask=mask, pre_tokens=pre, next_tokens=nxt, prefix=None, seq=seq,
                           n1=n1, allowed_modes=tuple(range(9))), seq


def _keep_sets_agree(spec, mask4d, seq, pre=INT_MAX, nxt=INT_MAX):
    for b, (sq, skv) in enumerate(zip(seq.q_lens, seq.kv_lens)):
        m = mask4d[b if mask4d.shape[0] > 1 else 0, :, :sq, :skv]
        want = _dense_keep(-pre, nxt, None, m, sq, skv, m.shape[0])
        got = _dense_keep(spec.lo[b], spec.hi[b], None, None, sq, skv, m.shape[0])
        assert torch.equal(got, want), b


BAND_MASKS = {  # name: (mask [6, 8], lo, hi)
    "causal": (_band(6, 8, -INF, 0), -INF, 0),
    "causal+2": (torch.ones(6, 8, dtype=torch.bool).triu(3), -INF, 2),
    "window": (_band(6, 8, -2, 1), -2, 1),
    "bottom-right": (_band(6, 8, -INF, 2), -INF, 2),
    "lower-bounded": (_band(6, 8, -1, INF), -1, INF),
    "nothing masked": (torch.zeros(6, 8, dtype=torch.bool), -INF, INF),
}


@pytest.mark.parametrize("name", sorted(BAND_MASKS))
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("form", ["SS", "11SS", "uint8"])
def test_an_explicit_mask_that_is_a_band_becomes_the_band(name, mode, form):
    m, lo, hi = BAND_MASKS[name]
    mask = {"SS": m, "11SS": m[None, None], "uint8": m.to(torch.uint8)}[form]
    spec, seq = _spec(mask, mode)
    if mode == 0:  # met with the token band (-pre_tokens, next_tokens), here (-INT_MAX, INT_MAX)
        lo, hi = max(lo, -INT_MAX), min(hi, INT_MAX)
    assert spec.explicit is None and (spec.lo[0], spec.hi[0]) == (lo, hi)
    _keep_sets_agree(spec, m[None, None], seq)


def test_an_explicit_band_meets_the_token_band():
    spec, seq = _spec(BAND_MASKS["causal"][0], pre=3, nxt=1)
    assert spec.explicit is None and (spec.lo[0], spec.hi[0]) == (-3, 0)
    _keep_sets_agree(spec, BAND_MASKS["causal"][0][None, None], seq, pre=3, nxt=1)


def test_per_batch_bands_and_varlen_slices():
    per_batch = torch.stack([_band(6, 8, -INF, 0), _band(6, 8, -1, 2)]).unsqueeze(1)  # [B, 1, S, S]
    spec, seq = _spec(per_batch, q_lens=(6, 6), kv_lens=(8, 8))
    assert spec.explicit is None and (spec.lo, spec.hi) == ((-INT_MAX, -1), (0, 2))
    big = torch.ones(9, 9, dtype=torch.bool).triu(1)  # TND: each batch reads its top-left slice
    spec, seq = _spec(big, q_lens=(3, 0, 5, 9), kv_lens=(4, 2, 5, 9))
    assert spec.explicit is None and spec.hi == (0, INT_MAX, 0, 0)  # (batch 1 is empty)
    _keep_sets_agree(spec, big[None, None], seq)


NOT_BANDS = {
    "one entry off": lambda: _band(6, 8, -INF, 0).index_put_((torch.tensor(3), torch.tensor(1)), torch.tensor(True)),
    "one entry off the middle row": lambda: _band(6, 8, -INF, 0).index_put_(
        (torch.tensor(4), torch.tensor(2)), torch.tensor(True)),
    "random": lambda: torch.rand(6, 8, generator=torch.Generator().manual_seed(0)) < 0.3,
    "first row masked": lambda: _band(6, 8, -INF, -1),
    "last row masked": lambda: torch.zeros(6, 8, dtype=torch.bool).index_fill_(0, torch.tensor(5), True),
}


@pytest.mark.parametrize("name", sorted(NOT_BANDS))
def test_masks_that_are_no_band_stay_explicit(name):
    m = NOT_BANDS[name]()
    spec, seq = _spec(m)
    assert spec.explicit is not None
    assert torch.equal(spec.explicit[0, 0], m)


@pytest.mark.parametrize("form", ["expanded", "materialized"])
def test_per_head_masks_with_one_band_become_the_band(form):
    m = _band(6, 8, -2, 1).expand(1, 2, 6, 8)
    spec, seq = _spec(m if form == "expanded" else m.contiguous())
    assert spec.explicit is None and (spec.lo[0], spec.hi[0]) == (-2, 1)


def test_heads_with_different_bands_and_mixed_batches_stay_explicit():
    per_head = torch.stack([_band(6, 8, -INF, 0), _band(6, 8, -INF, 1)]).unsqueeze(0)
    assert _spec(per_head)[0].explicit is not None
    mixed = torch.stack([_band(6, 8, -INF, 0), NOT_BANDS["random"]()]).unsqueeze(1)
    assert _spec(mixed, q_lens=(6, 6), kv_lens=(8, 8))[0].explicit is not None


def test_a_band_found_in_a_mask_is_found_again_after_an_in_place_change():
    m = _band(6, 8, -INF, 0)
    assert _spec(m)[0].explicit is None
    assert _spec(m)[0].explicit is None  # the remembered finding
    m[3, 1] = True  # same tensor, new content
    spec, _ = _spec(m)
    assert spec.explicit is not None and bool(spec.explicit[0, 0, 3, 1])
    with torch.inference_mode():  # no version counter: looked at every time
        inf_mask = _band(6, 8, -INF, 0)
        assert _spec(inf_mask)[0].explicit is None
        inf_mask[3, 1] = True
        assert _spec(inf_mask)[0].explicit is not None
