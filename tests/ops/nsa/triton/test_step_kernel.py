"""The decoding-step preparation kernel (positions, lookups, RoPE of q and k in one launch) gives the eager ops' bits:
single tokens and chunks, positions clamped into the pages, more heads than one tile, a head dim that is not a
power of two, signed zeros."""
from __future__ import annotations

import pytest
import torch

from attnops.nn.rotary import rotary_table
from attnops.ops.nsa import step

from .conftest import DEVICE


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bits as integers of its width."""
    return x.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()])


def _inputs(t: int, n1: int, n2: int, d: int, dtype, *, lengths=(5, 40), capacity=32, offset=3):
    gen = torch.Generator().manual_seed(t * 100 + n1 + d)
    b = len(lengths)
    q = (torch.randn(b * t, n1, d, generator=gen) * 4).to(dtype)
    k = (torch.randn(b * t, n2, d, generator=gen) * 4).to(dtype)
    q[0, 0] = -0.0  # products of signed zeros: the sum from 0 gives +0
    slots = torch.randint(0, 1000, (b, offset + capacity), generator=gen)
    compressed = torch.randint(0, 1000, (b, capacity), generator=gen)
    rope = rotary_table(capacity, d, 10000.0, dtype, torch.device("cpu"))
    args = (torch.tensor(lengths), t, slots, offset, compressed, rope, q, k)
    return [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("t,n1,n2,d", [(1, 16, 1, 16), (3, 4, 2, 24)])
def test_kernel_equals_the_eager_ops(triton_backend, dtype, t, n1, n2, d):
    args = _inputs(t, n1, n2, d, dtype)  # the second sequence runs past the 32 positions: clamped
    got = step.prepare_decode_step(*args)
    assert triton_backend == ["decode_step_kernel"]
    lengths, t, slots, offset, compressed, rope, q, k = args
    want = (*step.step_lookups(lengths, t, slots, offset, compressed),
            step.rotate_by_table(torch.cat([q, k], -2), rope.index_select(0, got[0].flatten())))
    for name, a, b in zip(("positions", "slots", "compressed", "ends", "qk"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(_bits(a), _bits(b)), name  # bitwise: signed zeros included
    assert got[0][1].tolist() == [31] * t  # past the pages: the last position
