"""The sparse attention kernel's fp8 e4m3fn decoding (the packed cache's codes, read as bytes and decoded from their
bits): every one of the 256 codes gives torch's value exactly (subnormals, both zeros, both NaN codes)."""
import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402  (after the skip)

from attnops.ops.dsa.triton.sparse_attention import _code_values  # noqa: E402
from tests.triton_backend import DEVICE  # noqa: E402

FP8_CODES = 2  # the kernel's QUANT for fp8 e4m3fn codes


@triton.jit
def _decode_kernel(codes_ptr, out_ptr):
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, _code_values(tl.load(codes_ptr + i), FP8_CODES))


def test_every_fp8_code_decodes_exactly():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=torch.float32, device=DEVICE)
    _decode_kernel[(1,)](codes.to(DEVICE), out)
    want = codes.view(torch.float8_e4m3fn).float()
    got = out.cpu()
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 2
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(got[finite].signbit(), want[finite].signbit())  # -0.0 stays negative
