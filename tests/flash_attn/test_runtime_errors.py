"""flash-attn refuses bad arguments with RuntimeError: the dialect's errors are RuntimeErrors too, and stay attnops
errors naming the argument."""
import pytest
import torch

from attnops._core.errors import ParamDtypeError, ParamInvalidError
from attnops.flash_attn import fa3, flash_attn_func, flash_attn_with_kvcache
from attnops.flash_attn.errors import FlashAttnArgumentError


def test_paged_cache_overflow_is_a_runtime_error_naming_block_table():
    cache = torch.randn(4, 256, 1, 64)
    with pytest.raises(RuntimeError, match="block_table") as info:
        flash_attn_with_kvcache(torch.randn(1, 1, 1, 64), cache, cache,
                                block_table=torch.zeros(1, 1, dtype=torch.int32),
                                cache_seqlens=torch.tensor([257], dtype=torch.int32))
    assert isinstance(info.value, ParamInvalidError) and isinstance(info.value, FlashAttnArgumentError)
    assert str(info.value).startswith("cache_seqlens: expected")


@pytest.mark.parametrize("function", [flash_attn_func, fa3.flash_attn_func])
def test_dtype_error_keeps_its_types(function):
    q = torch.ones(1, 4, 2, 8, dtype=torch.int32)
    with pytest.raises(RuntimeError) as info:
        function(q, q, q)
    assert isinstance(info.value, ParamDtypeError) and isinstance(info.value, TypeError)
    assert info.value.status == ParamDtypeError.status

