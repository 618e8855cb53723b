"""Errors of the flash-attn drop-in name the argument the caller passed (not the core's CANN name), what was
expected and the received value (strings quoted)."""
import re

import pytest
import torch

from attnops._core.errors import ParamDtypeError, ParamInvalidError, ParamNullptrError
from attnops.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

I32 = torch.int32


def _varlen(**overrides):
    q = torch.randn(6, 2, 8)
    args = dict(q=q, k=q, v=q, cu_seqlens_q=torch.tensor([0, 2, 6], dtype=I32),
                cu_seqlens_k=torch.tensor([0, 2, 6], dtype=I32), max_seqlen_q=4, max_seqlen_k=4)
    args.update(overrides)
    return flash_attn_varlen_func(**args)


@pytest.mark.parametrize("overrides,error,name,expected,received", [
    (dict(cu_seqlens_q=torch.tensor([0, 3, 2], dtype=I32)), ParamInvalidError, "cu_seqlens_q",
     "non-decreasing offsets", "[0, 3, 2]"),
    (dict(cu_seqlens_k=torch.tensor([0, 3, 2], dtype=I32)), ParamInvalidError, "cu_seqlens_k",
     "non-decreasing offsets", "[0, 3, 2]"),
    (dict(cu_seqlens_k=torch.tensor([0, 6], dtype=I32)), ParamInvalidError, "cu_seqlens_k",
     "the same length as cu_seqlens_q (3)", "[0, 6]"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 7], dtype=I32)), ParamInvalidError, "cu_seqlens_q",
     "a last offset <= the packed token count T=6", "[0, 2, 7]"),
    (dict(cu_seqlens_k=torch.tensor([0, 2, 9], dtype=I32)), ParamInvalidError, "cu_seqlens_k",
     "a last offset <= the packed token count T=6", "[0, 2, 9]"),
    (dict(max_seqlen_q=2), ParamInvalidError, "max_seqlen_q", "an int >= the longest sequence (4)", "2"),
    (dict(max_seqlen_k="4"), ParamInvalidError, "max_seqlen_k", "an int >= 0", "'4'"),
    (dict(window_size=(-2, 0)), ParamInvalidError, "window_size", "a pair (left, right) of ints >= -1", "(-2, 0)"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.float16)), ParamDtypeError, "alibi_slopes", "torch.float32",
     "dtype=torch.float16"),
    (dict(alibi_slopes=torch.ones(5, 2)), ParamInvalidError, "alibi_slopes",
     "(nheads=2,) or (batch_size=2, nheads=2)", "shape=[5, 2]"),
    (dict(softcap="1"), ParamInvalidError, "softcap", "a finite float >= 0", "'1'"),
    (dict(softmax_scale="1"), ParamDtypeError, "softmax_scale", "a finite float", "str '1'"),
    (dict(dropout_p=1.0), ParamInvalidError, "dropout_p", "a float in [0, 1)", "1.0"),
    (dict(causal="False"), ParamInvalidError, "causal", "a bool", "'False'"),
    (dict(block_table=torch.zeros(2, 2)), ParamDtypeError, "block_table", "torch.int32", "dtype=torch.float32"),
])
def test_varlen_errors_name_the_callers_argument(overrides, error, name, expected, received):
    with pytest.raises(error) as info:
        _varlen(**overrides)
    message = str(info.value)
    assert message.startswith(f"{name}: expected "), message
    assert expected in message.partition(", got ")[0] and received in message.partition(", got ")[2], message
    assert not re.search(r"actual_seq|\bpse\b|\bscale:", message), message


def test_dense_alibi_slopes_of_the_wrong_dtype_or_batch_name_alibi_slopes():
    q = torch.randn(2, 4, 3, 8)
    with pytest.raises(ParamDtypeError, match=r"^alibi_slopes: expected dtype in \['torch.float32'\], got .*float16"):
        flash_attn_func(q, q, q, alibi_slopes=torch.ones(3, dtype=torch.float16))
    with pytest.raises(ParamInvalidError, match=r"^alibi_slopes: .*\(batch_size=2, nheads=3\), got .*shape=\[4, 3\]"):
        flash_attn_func(q, q, q, alibi_slopes=torch.ones(4, 3))


@pytest.mark.parametrize("overrides,error,expected_message", [
    (dict(k=torch.randn(1, 8, 4, 8)), ParamInvalidError, "k: expected head dim equal to q's (16), got D=8"),
    (dict(k=torch.randn(2, 8, 4, 16)), ParamInvalidError, "k: expected batch size B=1 like q, got Tensor("),
    (dict(v=torch.randn(1, 7, 4, 16)), ParamInvalidError, "v: expected sequence length 8 and 4 heads like k, got "),
    (dict(k=torch.randn(1, 8, 4, 16).half()), ParamInvalidError, "k: expected dtype torch.float32 (same as q), got"),
    (dict(k=None), ParamNullptrError, "k: expected a tensor (required input), got None"),
])
def test_q_k_v_errors_use_flash_attns_names(overrides, error, expected_message):
    q = torch.randn(1, 8, 4, 16)
    args = dict(q=q, k=q, v=q)
    args.update(overrides)
    with pytest.raises(error) as info:
        flash_attn_func(**args)
    assert str(info.value).startswith(expected_message), str(info.value)


def test_kvcache_softmax_scale_is_named_softmax_scale():
    q, cache = torch.randn(2, 1, 4, 16), torch.randn(2, 32, 2, 16)
    with pytest.raises(ParamDtypeError, match=r"^softmax_scale: expected a finite float, got str '1'$"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=torch.tensor([3, 4], dtype=I32), softmax_scale="1")
