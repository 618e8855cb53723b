"""CAST_ROUND emulation (round to nearest, ties away from zero) and the precision argument's validation."""
import pytest
import torch

from attnops._core.errors import ParamInvalidError
from attnops.ops.common.npu_rounding import cast_round, check_precision, npu_rounding


def _grid_neighbours(dtype, n=4000, seed=0):
    """Pairs of consecutive ``dtype`` values (both signs, normal and subnormal) as fp32."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(1, 0x7b00 if dtype == torch.float16 else 0x7f00, (n,), generator=g, dtype=torch.int16)
    lo = bits.view(dtype).float()
    hi = (bits + 1).view(dtype).float()
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return lo * sign, hi * sign


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ties_go_away_from_zero(dtype):
    lo, hi = _grid_neighbours(dtype)
    mid = (lo + hi) / 2  # exact in fp32: a tie of dtype
    assert torch.equal(cast_round(mid, dtype).float(), hi)  # hi: the neighbour farther from zero
    assert not torch.equal(mid.to(dtype).float(), hi)  # PyTorch's cast (ties to even) differs on some


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_non_ties_round_to_nearest(dtype):
    lo, hi = _grid_neighbours(dtype, seed=1)
    x = torch.cat([lo + (hi - lo) * 0.49, lo + (hi - lo) * 0.51, lo, torch.tensor([0.0, -0.0, 1e6, float("inf")])])
    assert torch.equal(cast_round(x, dtype), x.to(dtype))


def test_precision_validation():
    assert check_precision("npu") == "npu"
    with pytest.raises(ParamInvalidError, match="precision"):
        check_precision("fast")
    assert npu_rounding("exact", torch.float16) is None
    assert npu_rounding("npu", torch.float32) is None  # fp32 runs fp32 end to end on the NPU
    assert npu_rounding("npu", torch.bfloat16).dtype == torch.bfloat16
