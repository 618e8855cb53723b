"""The softmax-statistics merge helpers against a plain full-attention computation and the fp64 golden.

Keys are split into disjoint parts, each part goes through ``attnops.flash_attention(return_stats=True)``, and the
merged result must be what one call over all keys gives (the golden's tolerance rule, golden = fp64 full attention).
"""
import pytest
import torch

import attnops
from attnops._core.softmax_stats import FLT_LOWEST, FLT_MAX
from attnops.ops.attention_update import attention_update, blocked_to_tnd, ring_attention_update, tnd_to_blocked
from attnops.testing.compare import assert_close_to_golden, fa_reductions
from attnops.testing.golden import fa_forward
from tests.helpers import F64, cum, make_qkv

SCALE = 0.35


def _golden(q, k, v, dtype, **kw):
    return fa_forward(q, k, v, scale=SCALE, dtype=dtype, **kw)


def _check(out, smax, ssum, q, k, v, **kw):
    g = _golden(q, k, v, F64, **kw)
    base = _golden(q, k, v, q.dtype, **kw)
    red = fa_reductions(q, k, v, layout=kw["input_layout"], head_num=kw["head_num"],
                        actual_seq_qlen=kw.get("actual_seq_qlen"), actual_seq_kvlen=kw.get("actual_seq_kvlen"))
    for name, actual, gold, bl in zip(("out", "softmax_max", "softmax_sum"), (out, smax, ssum), g, base):
        assert_close_to_golden(name, actual, gold, bl, factor=2, reduction=red[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ring_update_sbh_equals_full_attention(dtype):
    q, k, v, _ = make_qkv("SBH", b=2, n1=2, sq=6, skv=9, d=8, dtype=dtype)
    parts = [attnops.flash_attention(q, k[a:b], v[a:b], layout="SBH", head_num=2, scale=SCALE, return_stats=True)
             for a, b in ((0, 4), (4, 9))]
    out, smax, ssum = ring_attention_update(*parts[0][:3], *parts[1][:3], input_layout="SBH")
    assert out.dtype == dtype and smax.shape == (2, 2, 6, 8)
    _check(out, smax, ssum, q, k, v, head_num=2, input_layout="SBH")


@pytest.mark.parametrize("softmax_layout", ["", "TND"])
def test_ring_update_tnd_equals_full_attention(softmax_layout):
    q_lens, kv_lens = [3, 5, 2], [4, 3, 6]
    q, k, v, _ = make_qkv("TND", n1=2, d=8, q_lens=q_lens, kv_lens=kv_lens)
    split = [2, 1, 4]  # first part of each sequence's keys
    first = torch.cat([torch.arange(s, s + n) for s, n in zip([0, 4, 7], split)])
    second = torch.cat([torch.arange(s + n, s + t) for s, n, t in zip([0, 4, 7], split, kv_lens)])
    parts = []
    for idx, lens in ((first, split), (second, [t - n for t, n in zip(kv_lens, split)])):
        parts.append(attnops.flash_attention(q, k[idx], v[idx], layout="TND", actual_seq_qlen=cum(q_lens),
                                             actual_seq_kvlen=cum(lens), scale=SCALE,
                                             softmax_layout=softmax_layout, return_stats=True))
    starts = torch.tensor([0, *cum(q_lens)], dtype=torch.int64)
    out, smax, ssum = ring_attention_update(*parts[0][:3], *parts[1][:3], actual_seq_qlen=starts,
                                            input_layout="TND", input_softmax_layout=softmax_layout)
    _check(out, smax, ssum, q, k, v, head_num=2, input_layout="TND", actual_seq_qlen=cum(q_lens),
           actual_seq_kvlen=cum(kv_lens), softmax_layout=softmax_layout)


def test_ring_update_invalid_rows():
    """A part where a row saw no key contributes nothing; a row invalid in both parts stays invalid."""
    o1 = torch.ones(1, 1, 2)
    o2 = torch.full((1, 1, 2), 3.0)
    m1 = torch.tensor([FLT_LOWEST]).view(1, 1, 1, 1).expand(1, 1, 1, 8).clone()
    s1 = torch.full_like(m1, FLT_MAX)
    m2, s2 = torch.full_like(m1, 0.5), torch.full_like(m1, 2.0)
    out, smax, ssum = ring_attention_update(o1 * 0, m1, s1, o2, m2, s2)
    assert torch.equal(out, o2) and torch.equal(smax, m2) and torch.equal(ssum, s2)
    out, smax, ssum = ring_attention_update(o1 * 0, m1, s1, o1 * 0, m1, s1)
    assert torch.equal(out, o1 * 0) and torch.equal(smax, m1) and torch.equal(ssum, s1)


def test_ring_update_validation():
    o = torch.zeros(4, 1, 6)
    m = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="input_layout"):
        ring_attention_update(o, m, m, o, m, m, input_layout="BSH")
    with pytest.raises(ValueError, match="prev_softmax_max"):
        ring_attention_update(o, m[..., :1], m[..., :1], o, m[..., :1], m[..., :1])
    with pytest.raises(ValueError, match="cur_attn_out"):
        ring_attention_update(o, m, m, o[:2], m, m)
    with pytest.raises(TypeError, match="prev_softmax_max"):
        ring_attention_update(o, m.double(), m.double(), o, m.double(), m.double())
    t = torch.zeros(4, 2, 3)
    st = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="actual_seq_qlen"):
        ring_attention_update(t, st, st, t, st, st, input_layout="TND")
    with pytest.raises(ValueError, match="actual_seq_qlen"):
        ring_attention_update(t, st, st, t, st, st, input_layout="TND", actual_seq_qlen=torch.tensor([1, 4]))


def _lse_rows(res):
    """BSND output -> [B*S*N, D] rows and the [B*S*N] lse of a FlashAttentionResult."""
    lse = (res.softmax_max[..., 0] + torch.log(res.softmax_sum[..., 0])).permute(0, 2, 1).reshape(-1)
    return lse, res.out.reshape(-1, res.out.shape[-1])


@pytest.mark.parametrize("update_type", [0, 1])
def test_attention_update_equals_full_attention(update_type):
    q, k, v, _ = make_qkv("BSND", b=2, n1=3, sq=4, skv=10, d=8)
    bounds = ((0, 3), (3, 7), (7, 10))
    parts = [_lse_rows(attnops.flash_attention(q, k[:, a:b], v[:, a:b], layout="BSND", scale=SCALE,
                                               return_stats=True)) for a, b in bounds]
    out, lse = attention_update([p[0] for p in parts], [p[1] for p in parts], update_type)
    g_out, g_max, g_sum = _golden(q, k, v, F64, head_num=3, input_layout="BSND")
    b_out, b_max, b_sum = _golden(q, k, v, torch.float32, head_num=3, input_layout="BSND")
    red = fa_reductions(q, k, v, layout="BSND", head_num=3)
    assert_close_to_golden("out", out.view_as(q), g_out, b_out, factor=2, reduction=red["out"])
    to_lse = (lambda m, s: (m[..., 0] + torch.log(s[..., 0])).permute(0, 2, 1).reshape(-1))
    assert_close_to_golden("lse", lse, to_lse(g_max, g_sum), to_lse(b_max, b_sum), factor=2, reduction=red["lse"])


def test_attention_update_skips_invalid_lse():
    o = [torch.ones(2, 8), torch.full((2, 8), 5.0)]
    lse = [torch.tensor([float("inf"), 0.3]), torch.tensor([1.0, float("inf")])]
    out, merged = attention_update(lse, o, 1)
    assert torch.equal(out, torch.stack([o[1][0], o[0][1]])) and torch.allclose(merged, torch.tensor([1.0, 0.3]))
    out, merged = attention_update([torch.tensor([float("inf")])] * 2, [torch.ones(1, 8)] * 2, 1)
    assert torch.equal(out, torch.zeros(1, 8)) and torch.isinf(merged).all()


def test_attention_update_validation():
    o, lse = torch.zeros(3, 8), torch.zeros(3)
    with pytest.raises(ValueError, match="update_type"):
        attention_update([lse], [o], 2)
    with pytest.raises(ValueError, match="local_out"):
        attention_update([lse, lse], [o], 0)
    with pytest.raises(ValueError, match="lse\\[1\\]"):
        attention_update([lse, lse[:2]], [o, o], 0)
    with pytest.raises(TypeError, match="lse\\[0\\]"):
        attention_update([lse.half()], [o], 0)
    with pytest.raises(ValueError, match="lse"):
        attention_update([], [], 0)


@pytest.mark.parametrize("lens", [[3, 0, 4], [5], [2, 2, 1]])
def test_blocked_statistics_layout_round_trip(lens):
    """FlashAttention's blocked TND memory built by hand (per batch ``[N, Sq_b, 8]`` blocks, then the rows past the
    last batch token-major) against the conversions, given as host lengths or device-style prefix sums."""
    t, n = sum(lens) + 2, 3
    tnd = torch.arange(t * n * 8, dtype=torch.float32).view(t, n, 8)
    blocks, start = [], 0
    for length in lens:
        blocks.append(tnd[start:start + length].permute(1, 0, 2).reshape(-1))
        start += length
    blocked = torch.cat(blocks + [tnd[start:].reshape(-1)]).view(t, n, 8)
    prefix = torch.tensor([0, *cum(lens)], dtype=torch.int64)
    for given in (lens, prefix):
        assert torch.equal(tnd_to_blocked(tnd, given), blocked)
        assert torch.equal(blocked_to_tnd(blocked, given), tnd)


def test_blocked_statistics_layout_stays_in_range_for_any_prefix_sums():
    """Device prefix sums are not checked: any values give rows of the input, never an out-of-range index."""
    stats = torch.randn(6, 2, 8)
    for prefix in ([0, 9, 3], [-4, 2, 50], [7, 7, -1]):
        for convert in (blocked_to_tnd, tnd_to_blocked):
            out = convert(stats, torch.tensor(prefix))
            assert out.shape == stats.shape and bool(torch.isin(out, stats).all())
