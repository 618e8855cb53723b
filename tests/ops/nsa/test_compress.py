"""nsa_compress (+ backward) through the Pythonic API vs the fp64 golden."""
from __future__ import annotations

import pytest
import torch

import attnops

from .nsa_helpers import F64, check_compress, cum, randn

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", [[40], [0, 40, 17], [7, 33, 16, 5], [100]], ids=str)
def test_compress_matches_golden(dtype, lens):
    # leading 0 (empty batch), sequences shorter than a block, an exact block, tails that are dropped
    x = randn(sum(lens), 3, 16, dtype=dtype, seed=1)
    w = randn(16, 3, dtype=dtype, seed=2)
    check_compress(x, w, 16, 8, cum(lens) if lens[0] else [0] + cum(lens[1:]))


@pytest.mark.parametrize("block,stride", [(8, 8), (8, 4), (6, 4), (5, 1), (32, 16)])
def test_compress_block_stride(block, stride):
    lens = [3, 45, 0, 37]
    x = randn(sum(lens), 2, 4, dtype=torch.float32, seed=3)
    w = randn(block, 2, dtype=torch.float32, seed=4)
    check_compress(x, w, block, stride, cum(lens))


@pytest.mark.parametrize("block,stride", [(8, 8), (8, 4), (5, 1)])
def test_compress_block_stride_fp16(block, stride):
    lens = [3, 45, 0, 37]
    x = randn(sum(lens), 2, 16, dtype=torch.float16, seed=3)
    w = randn(block, 2, dtype=torch.float16, seed=4)
    check_compress(x, w, block, stride, cum(lens))


def test_compress_weight_grad_fp32_accumulation():
    """T=2048, N=2, D=128, l=32, d=16: fp32 weight_grad (a sum over blocks*D terms) within 3x of plain fp32."""
    x = randn(2048, 2, 128, dtype=torch.float32, seed=10)
    w = randn(32, 2, dtype=torch.float32, seed=20)
    dy = randn(127, 2, 128, dtype=torch.float32, seed=30)
    check_compress(x, w, 32, 16, [2048], dy=dy)


def test_compress_row_counts_and_leading_zero():
    x = randn(90, 2, 4, dtype=F64, seed=5)
    w = randn(8, 2, dtype=F64, seed=6)
    out = attnops.nsa_compress(x, w, block_size=8, stride=4, actual_seq_len=[0, 5, 40, 90])
    # 5 < 8 -> 0 rows; 35 -> (35-8)//4+1 = 7; 50 -> 11
    assert out.shape == (18, 2, 4)
    same = attnops.nsa_compress(x, w, block_size=8, stride=4, cu_seqlens=[0, 0, 5, 40, 90])
    torch.testing.assert_close(out, same, rtol=0, atol=0)
    only_short = attnops.nsa_compress(x[:5], w, block_size=8, stride=4, actual_seq_len=[5])
    assert only_short.shape == (0, 2, 4)


def test_compress_short_only_backward_is_zero():
    x = randn(7, 2, 4, dtype=torch.float32, seed=7).requires_grad_()
    w = randn(8, 2, dtype=torch.float32, seed=8).requires_grad_()
    out = attnops.nsa_compress(x, w, block_size=8, stride=4, actual_seq_len=[3, 7])
    assert out.shape == (0, 2, 4)
    out.sum().backward()
    assert x.grad is None or bool((x.grad == 0).all())
    assert w.grad is None or bool((w.grad == 0).all())


def test_compress_noncontiguous_inputs():
    lens = [20, 30]
    x = randn(16, 50, 3, dtype=torch.float32, seed=9).transpose(0, 1)  # [T, N, D] view, non-contiguous
    w = randn(3, 8, dtype=torch.float32, seed=10).t()
    assert not x.is_contiguous() and not w.is_contiguous()
    x = x.permute(0, 2, 1)  # [50, 3, 16]
    check_compress(x, w, 8, 4, cum(lens))


def test_compress_fp64():
    lens = [0, 19, 24]
    x = randn(43, 2, 3, dtype=F64, seed=11)
    w = randn(4, 2, dtype=F64, seed=12)
    from attnops.testing import golden_nsa as G

    torch.testing.assert_close(attnops.nsa_compress(x, w, block_size=4, stride=2, actual_seq_len=cum(lens[1:])),
                               G.nsa_compress(x, w, 4, 2, [0] + cum(lens[1:])))
