"""The DeepSeek-V4 compressor and lightning indexer v2 on the GPU hot path, checked without a GPU inside
:func:`attnops.testing.gpu_dry_run` (``meta`` tensors standing for GPU tensors): with their lengths, start positions,
residuals and block tables on the device, the calls validate shapes only, read no device value (any host read,
blocking upload or host-built kernel argument raises) and record their Triton launches."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.testing import gpu_dry_run

pytest.importorskip("triton")

I32 = torch.int32


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def kernels(launches) -> list[str]:
    return [record.kernel for record in launches]


@pytest.mark.parametrize("post", [False, True])
def test_compressor_records_its_kernels(post):
    """vllm-ascend's call: packed tokens of two requests, a paged state, start positions on the device (C4A, with
    and without the RMSNorm + RoPE of the output)."""
    extra = dict(norm_weight=meta(512), rope_sin=meta(18, 64), rope_cos=meta(18, 64)) if post else {}
    with gpu_dry_run() as launches:
        out = attnops.compressor(meta(64, 1024), meta(1024, 1024), meta(1024, 1024),
                                 meta(8, 128, 2048, dtype=torch.float32), meta(4, 1024, dtype=torch.float32),
                                 cmp_ratio=4, coff=2, state_block_table=meta(2, 4, dtype=I32),
                                 cu_seqlens=meta(3, dtype=I32), start_pos=meta(2, dtype=I32), **extra)
    assert out.shape == (18, 512)
    assert kernels(launches) == ["compressor_project_kernel"] * 2 + ["compressor_pool_kernel",
                                                                     "compressor_save_kernel"]
    assert launches[2].grid == (18, 1)  # one pool program per output row
    assert launches[2].constexprs["NORM"] == post and launches[2].constexprs["ROPE"] == post


def test_compressor_ring_state_and_batched_x():
    with gpu_dry_run() as launches:
        attnops.compressor(meta(2, 256, 1024), meta(512, 1024), meta(512, 1024),
                           meta(2, 256, 1024, dtype=torch.float32), meta(128, 512, dtype=torch.float32), cmp_ratio=128, coff=1, cache_mode=2,
                           state_block_table=meta(2, dtype=I32), seqused=meta(2, dtype=I32),
                           start_pos=meta(2, dtype=I32))
    assert kernels(launches)[-1] == "compressor_save_kernel" and launches[-1].constexprs["RING"]


def test_lightning_indexer_v2_and_its_quantised_form_record_the_kernel():
    lens = dict(layout="TND", layout_key="PA_BSND", cu_seqlens_q=meta(3, dtype=I32), seqused_k=meta(2, dtype=I32),
                block_table=meta(2, 8, dtype=I32), mask_mode=3, cmp_ratio=4, cmp_residual_k=meta(2, dtype=I32))
    with gpu_dry_run() as launches:
        res = attnops.lightning_indexer_v2(meta(64, 64, 128), meta(16, 128, 1, 128), meta(64, 64, dtype=torch.float32),
                                           topk=512, output_idx_offset=meta(64, 1, dtype=I32), **lens)
        attnops.quant_lightning_indexer_v2(meta(64, 64, 128, dtype=torch.int8), meta(16, 128, 1, 128, dtype=torch.int8),
                                           meta(64, 64, dtype=torch.float16), meta(64, 64, dtype=torch.float16),
                                           meta(16, 128, 1, dtype=torch.float16), topk=512, **lens)
    assert res.sparse_indices.shape == (64, 1, 512) and res.sparse_values.dtype == torch.float32
    assert kernels(launches) == ["indexer_v2_kernel"] * 2
    assert launches[0].constexprs["CAUSAL"] and launches[0].constexprs["OFFSET"]
    assert launches[1].constexprs["UPCAST"]  # the dequantised fp32 inputs


def test_device_metadata_shapes_are_still_checked():
    with gpu_dry_run(), pytest.raises(attnops.AclnnError, match="start_pos"):
        attnops.compressor(meta(64, 1024), meta(1024, 1024), meta(1024, 1024), meta(8, 128, 2048, dtype=torch.float32),
                           meta(4, 1024, dtype=torch.float32), cmp_ratio=4, coff=2,
                           state_block_table=meta(2, 4, dtype=I32), cu_seqlens=meta(3, dtype=I32),
                           start_pos=meta(3, dtype=I32))
    with gpu_dry_run(), pytest.raises(attnops.AclnnError, match="cmp_residual_k"):
        attnops.lightning_indexer_v2(meta(64, 64, 128), meta(16, 128, 1, 128), meta(64, 64, dtype=torch.float32),
                                     topk=512, layout="TND", layout_key="PA_BSND", cu_seqlens_q=meta(3, dtype=I32),
                                     seqused_k=meta(2, dtype=I32), block_table=meta(2, 8, dtype=I32), mask_mode=3,
                                     cmp_ratio=4)
