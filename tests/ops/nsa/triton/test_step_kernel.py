"""The decoding-step preparation kernel (positions, lookups, RoPE of q and k in one launch) gives the eager ops' bits:
single tokens and chunks, positions clamped into the pages, more heads than one tile, a head dim that is not a
power of two, signed zeros; it writes the compressed-attention masks of the rule (first positions, a block just
completed, chunks, clamped positions)."""
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
    got, written = step.prepare_decode_step(*args)
    assert triton_backend == ["decode_step_kernel"] and not written
    lengths, t, slots, offset, compressed, rope, q, k = args
    want = (*step.step_lookups(lengths, t, slots, offset, compressed),
            step.rotate_by_table(torch.cat([q, k], -2), rope.index_select(0, got[0].flatten())))
    for name, a, b in zip(("positions", "slots", "compressed", "ends", "qk"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(_bits(a), _bits(b)), name  # bitwise: signed zeros included
    assert got[0][1].tolist() == [31] * t  # past the pages: the last position


@pytest.mark.parametrize("t,lengths", [(1, (0, 3)), (1, (21, 3)), (3, (13, 13)), (2, (40, 40))])
def test_kernel_writes_the_compressed_masks(triton_backend, t, lengths):
    rows, n_sel, block, stride, select_block, local = 12, 3, 8, 4, 16, 2
    masks = step.CompressedMasks(torch.zeros(t, rows + n_sel, dtype=torch.bool, device=DEVICE), rows, n_sel, block,
                                 stride, select_block, local)
    (positions, *_), written = step.prepare_decode_step(*_inputs(t, 2, 1, 8, torch.float32, lengths=lengths), masks)
    assert written and triton_backend == ["decode_step_kernel"]
    pos = positions[0].cpu()[:, None]  # the first sequence's tokens
    own, cols = pos // select_block, torch.arange(n_sel)
    atten = torch.arange(rows) * stride + block - 1 > pos
    forced = (cols == 0) | ((cols <= own) & (cols > own - local))
    assert torch.equal(masks.out.cpu(), torch.cat([atten, forced], 1))


@pytest.mark.parametrize("prefill", [3, 21])
def test_the_module_step_on_the_kernel_equals_the_eager_step(triton_backend, monkeypatch, prefill):
    """``attnops.nn``'s step lookups, rotated q/k and compressed-attention masks: the kernel's equal the eager ops'."""
    from attnops.nn import NativeSparseAttention
    from attnops.nn.nsa_step import compressed_masks, decode_step

    torch.manual_seed(0)
    m = NativeSparseAttention(16, 4, 2, 8, compress_block_size=8, compress_stride=4, select_block_size=8,
                              select_block_count=3, window_size=6, local_blocks=2).to(DEVICE)
    cache = m.new_cache(2, page_size=4)
    q, k = torch.randn(2, 4, 8, device=DEVICE), torch.randn(2, 2, 8, device=DEVICE)
    with torch.no_grad():
        monkeypatch.setenv("ATTNOPS_BACKEND", "reference")
        m(torch.randn(2, prefill, 16, device=DEVICE), cache=cache)
        steps = {}
        for backend in ("reference", "triton"):
            monkeypatch.setenv("ATTNOPS_BACKEND", backend)
            step, qk = decode_step(cache, q, k, window=6, local_blocks=2, theta=10000.0)
            rows = cache.compressed_rows()
            masks = [x.clone() for x in compressed_masks(step, rows, rows // 2, 8, 4, 8)]
            steps[backend] = (step.positions, step.slots, step.compressed_slots, step.ends, qk, *masks)
    assert step.masks_ready and triton_backend == ["decode_step_kernel"]
    for a, b in zip(*steps.values()):
        assert torch.equal(_bits(a) if a.is_floating_point() else a, _bits(b) if b.is_floating_point() else b)
