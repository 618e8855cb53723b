"""NativeSparseAttention validates its settings at construction and its inputs at every call: each bad argument
raises attnops' error naming it, what was expected and what was received (never a PyTorch shape error)."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.nn import NativeSparseAttention

HIDDEN = 16
SETTINGS = dict(compress_block_size=8, compress_stride=4, select_block_size=16, select_block_count=4, window_size=16)


def _layer(hidden=HIDDEN, **settings):
    torch.manual_seed(0)
    return NativeSparseAttention(hidden, 4, 2, 8, **{**SETTINGS, **settings})


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("hidden, settings, error, match", [
    (0, {}, attnops.ParamInvalidError, "hidden_size: expected an int in \\[1, inf\\], got 0"),
    (16.0, {}, attnops.ParamDtypeError, "hidden_size: expected an int, got 16.0"),
    (HIDDEN, dict(compress_block_size=0), attnops.ParamInvalidError, "compress_block_size: expected an int in \\[1"),
    (HIDDEN, dict(compress_stride=16), attnops.ParamInvalidError, "compress_stride: expected an int in \\[1, 8\\]"),
    (HIDDEN, dict(compress_stride=3), attnops.ParamInvalidError, "select_block_size: expected a multiple of "
                                                                 "compress_stride=3, got 16"),
    (HIDDEN, dict(select_block_size=4), attnops.ParamInvalidError, "select_block_size: expected an int in \\[8"),
    (HIDDEN, dict(select_block_count=0), attnops.ParamInvalidError, "select_block_count: expected an int in \\[1"),
    (HIDDEN, dict(window_size=-1), attnops.ParamInvalidError, "window_size: expected an int in \\[0"),
    (HIDDEN, dict(local_blocks=-1), attnops.ParamInvalidError, "local_blocks: expected an int in \\[0"),
    (HIDDEN, dict(rope_theta="1e4"), attnops.ParamDtypeError, "rope_theta: expected a finite float, got str"),
    (HIDDEN, dict(rope_theta=0.0), attnops.ParamInvalidError, "rope_theta: expected a positive float, got 0.0"),
])
def test_settings_are_checked_at_construction(hidden, settings, error, match):
    with pytest.raises(error, match=match):
        _layer(hidden, **settings)


def test_new_cache_checks_page_size():
    with pytest.raises(attnops.ParamInvalidError, match="page_size: expected an int in \\[1, inf\\], got 0"):
        _layer().new_cache(2, page_size=0)


@pytest.mark.parametrize("x, error, match", [
    (_x(2, 10, 12), attnops.ParamInvalidError, "x: expected \\[B, T, hidden=16\\] or packed \\[T, hidden=16\\], got "
                                               "Tensor\\(shape=\\[2, 10, 12\\]"),
    (_x(20, 12), attnops.ParamInvalidError, "x: expected \\[B, T, hidden=16\\] .* got Tensor\\(shape=\\[20, 12\\]"),
    (_x(1, 2, 10, 16), attnops.ParamInvalidError, "x: expected \\[B, T, hidden=16\\] .* got Tensor\\(shape=\\[1, 2,"),
    (_x(16), attnops.ParamInvalidError, "x: expected \\[B, T, hidden=16\\] .* got Tensor\\(shape=\\[16\\]"),
    (_x(2, 10, 16).double(), attnops.ParamDtypeError, "x: expected dtype torch.float32 \\(the layer's parameters\\), "
                                                      "got .*torch.float64.*x.to\\(torch.float32\\)"),
    (torch.ones(2, 10, 16, dtype=torch.int64), attnops.ParamDtypeError, "x: expected dtype torch.float32"),
    (torch.empty(2, 10, 16, device="meta"), attnops.ParamInvalidError, "x: expected a tensor on cpu \\(the layer's "
                                                                       "parameters\\), got .*device=meta.*x.to"),
    (_x(2, 10, 16).numpy(), attnops.ParamDtypeError, "x: expected a torch.Tensor, got numpy.ndarray"),
], ids=["hidden", "packed-hidden", "rank-4", "rank-1", "dtype", "integer", "device", "numpy"])
def test_x_is_checked(x, error, match):
    with pytest.raises(error, match=match):
        _layer()(x)


def test_x_of_another_dtype_under_autocast_is_accepted():
    layer = _layer()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(_x(1, 9, HIDDEN).bfloat16()).shape == (1, 9, HIDDEN)


@pytest.mark.parametrize("cu_seqlens, match", [
    ([0, 20], "a last offset equal to x's token count T=40, got \\[0, 20\\]"),
    (torch.tensor([0, 20]), "a last offset equal to x's token count T=40, got \\[0, 20\\]"),
    ([0, 20, 50], "a last offset equal to x's token count T=40"),
    ([0, 30, 20, 40], "non-decreasing offsets, got \\[0, 30, 20, 40\\]"),
    ([0, 40, 0], "non-decreasing offsets, got \\[0, 40, 0\\]"),
    ([20, 40], "the offsets .* a leading 0 and B \\+ 1 entries, got \\[20, 40\\]"),
    ([0], "the offsets .* a leading 0 and B \\+ 1 entries, got \\[0\\]"),
    (torch.tensor([[0, 20, 40]]), "a 1-D integer tensor"),
    (torch.tensor([0.0, 20.0, 40.0]), "a 1-D integer tensor"),
], ids=["short", "short-tensor", "long", "decreasing", "trailing-zero", "no-leading-zero", "one-entry", "2-D",
        "float"])
def test_cu_seqlens_is_checked(cu_seqlens, match):
    with pytest.raises(attnops.ParamInvalidError, match="cu_seqlens: expected " + match):
        _layer()(_x(40, HIDDEN), cu_seqlens=cu_seqlens)


def test_cu_seqlens_with_an_empty_sequence_is_accepted():
    layer, x = _layer(), _x(40, HIDDEN)
    torch.testing.assert_close(layer(x, cu_seqlens=[0, 25, 25, 40]), layer(x, cu_seqlens=[0, 25, 40]))
