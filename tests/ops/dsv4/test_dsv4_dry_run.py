"""The DeepSeek-V4 compressor and lightning indexer v2 have no Triton kernel: inside
:func:`attnops.testing.gpu_dry_run` (``meta`` tensors standing for GPU tensors) they raise saying they would run the
reference, before reading any device value (their lengths and tables are host metadata read by the reference)."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.testing import gpu_dry_run

I32 = torch.int32


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


NO_KERNEL = "would run the reference.*no Triton kernel"


def test_compressor_says_it_has_no_kernel():
    with gpu_dry_run(), pytest.raises(RuntimeError, match=NO_KERNEL):
        attnops.compressor(meta(64, 1024), meta(1024, 1024), meta(1024, 1024), meta(8, 128, 2048, dtype=torch.float32),
                           meta(4, 1024, dtype=torch.float32), cmp_ratio=4, coff=2,
                           state_block_table=meta(2, 4, dtype=I32), cu_seqlens=meta(3, dtype=I32),
                           start_pos=meta(2, dtype=I32))


def test_lightning_indexer_v2_and_its_quantised_form_say_they_have_no_kernel():
    lens = dict(layout="TND", layout_key="PA_BSND", cu_seqlens_q=meta(3, dtype=I32), seqused_k=meta(2, dtype=I32),
                block_table=meta(2, 8, dtype=I32), mask_mode=3, cmp_ratio=4, cmp_residual_k=meta(2, dtype=I32))
    with gpu_dry_run(), pytest.raises(RuntimeError, match=NO_KERNEL):
        attnops.lightning_indexer_v2(meta(64, 64, 128), meta(16, 128, 1, 128), meta(64, 64, dtype=torch.float32),
                                     topk=512, **lens)
    with gpu_dry_run(), pytest.raises(RuntimeError, match=NO_KERNEL):
        attnops.quant_lightning_indexer_v2(meta(64, 64, 128, dtype=torch.int8), meta(16, 128, 1, 128, dtype=torch.int8),
                                           meta(64, 64, dtype=torch.float16), meta(64, 64, dtype=torch.float16),
                                           meta(16, 128, 1, dtype=torch.float16), topk=512, **lens)
