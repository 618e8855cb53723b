"""A NativeSparseAttention / NSACache call with 0 new tokens is a no-op step: an empty output ``[B, 0, hidden]``,
the cache unchanged, and the following calls give what they give without it (first call and after a prefill)."""
from __future__ import annotations

import torch

from attnops.nn import NativeSparseAttention

HIDDEN = 16
SIZES = dict(compress_block_size=8, compress_stride=4, select_block_size=16, select_block_count=4, window_size=16)


def _layer():
    torch.manual_seed(0)
    return NativeSparseAttention(HIDDEN, 4, 2, 8, **SIZES).double()


def _x(b, t, seed=1):
    return torch.randn(b, t, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _state(cache):
    return (cache.seq_len, cache.compressed_len, cache.lengths.tolist(),
            None if cache.key_pages is None else cache.key_pages.clone())


def _decode(layer, steps, empty_at=()):
    """Outputs of ``steps`` (token counts) through one cache, with 0-token calls inserted before the steps in
    ``empty_at``; asserts each such call returns ``[B, 0, hidden]`` and changes nothing."""
    cache, outs = layer.new_cache(2), []
    with torch.no_grad():
        for i, t in enumerate(steps):
            if i in empty_at:
                before = _state(cache)
                empty = layer(_x(2, 0), cache=cache)
                assert empty.shape == (2, 0, HIDDEN) and empty.dtype == torch.float64
                after = _state(cache)
                assert before[:3] == after[:3]
                assert (before[3] is None) == (after[3] is None)
                if before[3] is not None:
                    assert torch.equal(before[3], after[3])
            outs.append(layer(_x(2, t, seed=10 + i), cache=cache))
    return outs


def test_zero_tokens_on_the_first_call_and_after_a_prefill_is_a_no_op():
    layer = _layer()
    steps = [20, 1, 3]
    expected = _decode(layer, steps)
    for got, want in zip(_decode(layer, steps, empty_at=(0, 1, 2)), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_appending_zero_tokens_to_the_cache_changes_nothing():
    layer = _layer()
    cache = layer.new_cache(2)
    with torch.no_grad():
        layer(_x(2, 12), cache=cache)
    before = _state(cache)
    empty = torch.zeros(2, 0, 2, 8, dtype=torch.float64)
    cache.append(empty, empty)
    after = _state(cache)
    assert before[:3] == after[:3] and torch.equal(before[3], after[3])
