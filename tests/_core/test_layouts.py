"""Layouts BSH / SBH / BSND / BNSD / TND <-> the internal token view ([B, S, N, D] or [T, N, D])."""
import pytest
import torch

from attnops import ParamInvalidError
from attnops._core.layouts import (LAYOUTS, batch_tokens, normalize_layout, parse_geometry, token_strides,
                                   tokens_view, with_head_dim)
from attnops._core.varlen import SeqInfo, seq_info_varlen

B, S, N, D = 2, 5, 3, 4


def _bsnd(seed=0):
    return torch.randn(B, S, N, D, generator=torch.Generator().manual_seed(seed))


def _from_bsnd(x, layout):
    """Independent construction of a layout from [B, S, N, D]."""
    b, s, n, d = x.shape
    if layout == "BSND":
        return x.clone()
    if layout == "BNSD":
        return x.transpose(1, 2).contiguous()
    if layout == "BSH":
        return x.reshape(b, s, n * d).clone()
    if layout == "SBH":
        return x.transpose(0, 1).reshape(s, b, n * d).contiguous()
    raise ValueError(layout)


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH", "SBH"])
def test_dense_round_trip(layout):
    x = _bsnd()
    t = _from_bsnd(x, layout)
    view = tokens_view(t, layout, N)
    assert view.shape == (B, S, N, D) and torch.equal(view, x)
    assert view.data_ptr() == t.data_ptr()  # a view: no copy
    # writes through the view land in the layout's tensor (used for outputs and gradients)
    y = _bsnd(seed=1)
    view.copy_(y)
    assert torch.equal(t, _from_bsnd(y, layout))


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH", "SBH", "TND"])
def test_token_strides_are_the_views(layout):
    """token_strides reads the (batch, token, head) strides of tokens_view off a (non-contiguous) tensor without the
    view (TND: batch stride 0)."""
    x = {"BSND": torch.empty(B, S, 2 * N, 11)[:, :, ::2, :D], "BNSD": torch.empty(B, 2 * N, S, 11)[:, ::2, :, :D],
         "BSH": torch.empty(B, S, N * D + 3)[..., 1:1 + N * D], "SBH": torch.empty(S, B, N * D + 3)[..., 1:1 + N * D],
         "TND": torch.empty(9, N, 11)[..., :D]}[layout]
    view = tokens_view(x, layout, N)
    assert token_strides(x, layout, N) == ((0, *view.stride()[:2]) if layout == "TND" else view.stride()[:3])


def test_tnd_round_trip_and_batches():
    x = torch.randn(9, N, D)
    assert tokens_view(x, "TND", N) is x
    seq = seq_info_varlen([2, 0, 4], [3, 3, 1])
    assert torch.equal(batch_tokens(x, seq, 0), x[0:2])
    assert batch_tokens(x, seq, 1).shape == (0, N, D)
    assert torch.equal(batch_tokens(x, seq, 2), x[2:6])
    assert torch.equal(batch_tokens(x, seq, 1, kv=True), x[3:6])
    assert torch.equal(batch_tokens(x, seq, 2, kv=True), x[6:7])


def test_dense_batches():
    x = _bsnd()
    view = tokens_view(_from_bsnd(x, "SBH"), "SBH", N)
    seq = SeqInfo.dense(B, S, S)
    for b in range(B):
        assert torch.equal(batch_tokens(view, seq, b), x[b])


@pytest.mark.parametrize("layout,shape,heads,dim,want", [
    ("BSH", (2, 5, 12), 3, 2, (2, 5, 6)), ("SBH", (5, 2, 12), 3, 4, (5, 2, 12)),
    ("BNSD", (2, 3, 5, 4), 3, 2, (2, 3, 5, 2)), ("TND", (7, 3, 4), 3, 1, (7, 3, 1))])
def test_with_head_dim(layout, shape, heads, dim, want):
    assert with_head_dim(torch.Size(shape), layout, heads, dim) == want


def test_normalize_layout():
    assert normalize_layout("input_layout", "bnsd") == "BNSD"
    assert set(LAYOUTS) == {"BSH", "SBH", "BSND", "BNSD", "TND"}
    for bad in ("NSD", "", None, 3):
        with pytest.raises(ParamInvalidError, match="input_layout"):
            normalize_layout("input_layout", bad)


def test_parse_geometry_gqa_and_dv():
    q, k, v = torch.zeros(2, 5, 24), torch.zeros(2, 7, 6), torch.zeros(2, 7, 4)  # BSH, N1=4, D=6, N2=1, Dv=4
    g = parse_geometry(q, k, v, 4, "BSH")
    assert (g.n1, g.n2, g.d, g.dv, g.batch, g.sq, g.skv, g.group) == (4, 1, 6, 4, 2, 5, 7, 4)
    g = parse_geometry(torch.zeros(9, 8, 16), torch.zeros(11, 2, 16), torch.zeros(11, 2, 8), 8, "TND")
    assert (g.n1, g.n2, g.d, g.dv, g.group) == (8, 2, 16, 8, 4)


@pytest.mark.parametrize("q,k,v,heads,layout,name", [
    ((2, 3, 5, 4), (2, 2, 5, 4), (2, 2, 5, 4), 3, "BNSD", "key"),      # N1 % N2 != 0
    ((2, 4, 5, 4), (2, 2, 5, 6), (2, 2, 5, 4), 4, "BNSD", "key"),      # Dk != Dq
    ((2, 4, 5, 4), (2, 2, 5, 4), (2, 2, 5, 6), 4, "BNSD", "value"),    # Dv > D
    ((2, 4, 5, 4), (3, 2, 5, 4), (3, 2, 5, 4), 4, "BNSD", "key"),      # batch mismatch
    ((2, 4, 5, 4), (2, 2, 5, 4), (2, 2, 6, 4), 4, "BNSD", "value"),    # key/value S mismatch
    ((2, 4, 5, 4), (2, 2, 5, 4), (2, 2, 5, 4), 2, "BNSD", "head_num"),
    ((2, 5, 10), (2, 5, 10), (2, 5, 10), 3, "BSH", "head_num"),         # H not divisible
    ((6, 2, 4), (6, 2, 4), (5, 2, 4), 2, "TND", "value"),             # T of key != T of value
    ((6, 2, 4), (6, 2, 4), (6, 2, 4), 2, "BSND", "query"),            # wrong rank
])
def test_parse_geometry_rejects(q, k, v, heads, layout, name):
    with pytest.raises(ParamInvalidError, match=f"^{name}"):
        parse_geometry(torch.zeros(q), torch.zeros(k), torch.zeros(v), heads, layout)
