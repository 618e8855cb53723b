"""NSACache belongs to one NativeSparseAttention layer: another layer (equal settings, a copy, other settings), under
eager and torch.compile, raises naming ``cache`` before anything is written; a directly constructed cache binds to its
first layer; one cache per layer decodes a stack of layers exactly; a copy of a cache stays its layer's."""
from __future__ import annotations

import copy

import pytest
import torch

import attnops
from attnops.nn import NativeSparseAttention, NSACache

HIDDEN = 16
SIZES = dict(compress_block_size=8, compress_stride=4, select_block_size=16, select_block_count=4)
ANOTHER = "cache: expected a cache made by this layer's new_cache\\(\\), got the cache of another layer"


def _layer(seed=0, **settings):
    torch.manual_seed(seed)
    return NativeSparseAttention(HIDDEN, 4, 2, 8, **{**SIZES, "window_size": 16, **settings}).double()


def _x(b, t, seed=1):
    return torch.randn(b, t, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _prefilled(layer, x):
    cache = layer.new_cache(x.shape[0])
    with torch.no_grad():
        layer(x, cache=cache)
    return cache


def _unchanged(cache, step):
    """``step()`` raises ParamInvalidError naming the other layer, and ``cache`` is left as it was."""
    before = (cache.seq_len, cache.compressed_len, cache.key_pages.clone(), cache.lengths.clone())
    with torch.no_grad(), pytest.raises(attnops.ParamInvalidError, match=ANOTHER) as err:
        step()
    assert (cache.seq_len, cache.compressed_len) == before[:2]
    assert torch.equal(cache.key_pages, before[2]) and torch.equal(cache.lengths, before[3])
    return str(err.value)


def test_a_cache_shared_by_two_layers_raises():
    a, b = _layer(0), _layer(1)
    x = _x(2, 30)
    cache = _prefilled(a, x)
    message = _unchanged(cache, lambda: b(x[:, :1], cache=cache))
    assert "one cache per layer" in message and "caches[i]" in message


@pytest.mark.parametrize("setting, value", [("compress_block_size", 16), ("window_size", 8), ("local_blocks", 1),
                                            ("compress", "mean")])
def test_a_layer_with_other_settings_names_the_cache_and_the_setting(setting, value):
    x = _x(2, 30)
    cache = _prefilled(_layer(), x)
    message = _unchanged(cache, lambda: _layer(**{setting: value})(x[:, :1], cache=cache))
    assert f"{setting}=" in message


def test_another_head_count_names_the_cache():
    torch.manual_seed(0)
    other = NativeSparseAttention(HIDDEN, 4, 1, 8, **SIZES, window_size=16).double()
    cache = _prefilled(_layer(), _x(2, 30))
    assert "num_kv_heads=2 (this layer: 1)" in _unchanged(cache, lambda: other(_x(2, 1), cache=cache))


def test_a_copy_of_a_layer_is_another_layer_and_a_copy_of_a_cache_stays_its_layers():
    layer = _layer()
    x = _x(2, 31)
    cache = _prefilled(layer, x[:, :30])
    _unchanged(cache, lambda: copy.deepcopy(layer)(x[:, 30:], cache=cache))
    twin = copy.deepcopy(cache)
    with torch.no_grad():
        torch.testing.assert_close(layer(x[:, 30:], cache=twin), layer(x)[:, 30:], rtol=1e-10, atol=1e-12)


def test_the_settings_changed_after_new_cache_raise():
    layer = _layer()
    cache = _prefilled(layer, _x(2, 30))
    layer.config["window_size"] = 8
    with torch.no_grad(), pytest.raises(attnops.ParamInvalidError, match="other settings \\(window_size=16 \\(this"):
        layer(_x(2, 1), cache=cache)


def test_one_cache_per_layer_decodes_a_stack_exactly():
    layers = [_layer(0), _layer(1)]
    x = _x(2, 24)

    def stack(h, caches=None):
        for i, layer in enumerate(layers):
            h = h + layer(h, cache=None if caches is None else caches[i])
        return h
    caches = [layer.new_cache(2) for layer in layers]
    with torch.no_grad():
        got = torch.cat([stack(x[:, :20], caches)] + [stack(x[:, t:t + 1], caches) for t in range(20, 24)], 1)
        torch.testing.assert_close(got, stack(x), rtol=1e-10, atol=1e-12)


def test_a_directly_constructed_cache_binds_to_its_first_layer():
    layer, x = _layer(), _x(2, 21)
    wrong = NSACache(2, compress_block_size=8, compress_stride=4, page_size=16)
    with torch.no_grad(), pytest.raises(attnops.ParamInvalidError,
                                        match="cache: expected a cache with this layer's sizes, got a cache with "
                                              "select_block_size=None \\(this layer: 16\\)"):
        layer(x, cache=wrong)
    assert wrong.seq_len == 0 and wrong.layer_settings is None
    cache = NSACache(2, **SIZES, page_size=8)
    with torch.no_grad():
        got = torch.cat([layer(x[:, :20], cache=cache), layer(x[:, 20:], cache=cache)], 1)
        torch.testing.assert_close(got, layer(x), rtol=1e-10, atol=1e-12)
    assert cache.layer_settings["window_size"] == 16
    _unchanged(cache, lambda: _layer(1)(x[:, :1], cache=cache))


def test_not_a_cache_raises():
    with torch.no_grad(), pytest.raises(attnops.ParamDtypeError, match="cache: expected an NSACache .* got dict"):
        _layer()(_x(2, 3), cache={})


def test_compiled_call_with_another_layers_cache_raises():
    torch._dynamo.reset()
    a, b = _layer(0), _layer(1)
    x = _x(2, 30)
    own, foreign = _prefilled(b, x), _prefilled(a, x)
    step = torch.compile(lambda t, cache: b(t, cache=cache), backend="eager")
    with torch.no_grad():
        step(x[:, :1], own)  # compiled with a cache of b: then a cache of a must not pass the guards
    _unchanged(foreign, lambda: step(x[:, :1], foreign))


def test_a_cache_keeps_the_dtype_of_its_first_call():
    layer = _layer()
    cache = _prefilled(layer, _x(2, 20))
    layer.float()
    with torch.no_grad(), pytest.raises(attnops.ParamInvalidError, match="cache: expected keys of the cached heads, "
                                        "dtype and device .*torch.float64.*got keys .*torch.float32.*new_cache"):
        layer(_x(2, 1).float(), cache=cache)
    assert cache.seq_len == 20


@pytest.mark.parametrize("sizes, match", [
    (dict(compress_block_size=0, compress_stride=1), "compress_block_size: expected an int in \\[1"),
    (dict(compress_block_size=4, compress_stride=8), "compress_stride: expected an int in \\[1, 4\\]"),
    ({**SIZES, "select_block_size": 10}, "select_block_size: expected a multiple of compress_stride=4"),
    ({**SIZES, "select_block_count": 0}, "select_block_count: expected an int in \\[1"),
])
def test_a_directly_constructed_cache_checks_its_sizes(sizes, match):
    with pytest.raises(attnops.ParamInvalidError, match=match):
        NSACache(2, page_size=8, **sizes)


@pytest.mark.parametrize("k, v, match", [
    (torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), "k: expected a tensor with ndim in \\[4\\]"),
    (torch.zeros(3, 3, 2, 8), torch.zeros(3, 3, 2, 8), "k: expected \\[B=2 \\(the cache's\\), t, N2, D\\]"),
    (torch.zeros(2, 3, 2, 8), torch.zeros(2, 4, 2, 8), "v: expected shape \\[2, 3, 2, \\*\\]"),
])
def test_append_checks_keys_and_values(k, v, match):
    cache = NSACache(2, **SIZES, page_size=8)
    with pytest.raises(attnops.ParamInvalidError, match=match):
        cache.append(k, v)
    with pytest.raises(attnops.ParamInvalidError, match="end: expected a token range within the 0 cached tokens"):
        cache.rows(0, 0)
