"""DeepSeek-V4 sparse flash MLA on the GPU hot path, checked without a GPU inside
:func:`attnops.testing.gpu_dry_run`: there is no Triton kernel yet, so ``sparse_flash_mla`` and
``sparse_flash_mla_grad`` raise saying they would run the reference, after validating without reading a device value;
``sparse_flash_mla_metadata`` / ``sparse_flash_mla_grad_metadata`` return their tensor on the device."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.testing import gpu_dry_run

META = torch.device("meta")
T, B, BLOCKS, PAGE = 6, 2, 8, 16


def meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(*shape, device=META, dtype=dtype, requires_grad=grad)


def _call_kwargs():
    i32 = torch.int32
    return dict(cmp_kv=meta(BLOCKS, PAGE, 1, 64), cmp_sparse_indices=meta(T, 1, 8, dtype=i32), cmp_ratio=4,
                sinks=meta(4, dtype=torch.float32), layout_q="TND", layout_kv="PA_BBND",
                ori_block_table=meta(B, 4, dtype=i32), cmp_block_table=meta(B, 4, dtype=i32),
                cu_seqlens_q=meta(B + 1, dtype=i32), seqused_ori_kv=meta(B, dtype=i32),
                cmp_residual_kv=meta(B, dtype=i32))


def test_attention_and_grad_say_they_have_no_kernel_after_validating_without_host_reads():
    q, ori = meta(T, 4, 64), meta(BLOCKS, PAGE, 1, 64)
    with gpu_dry_run(), pytest.raises(RuntimeError, match="would run the reference.*no Triton kernel"):
        attnops.sparse_flash_mla(q, ori, **_call_kwargs())
    with gpu_dry_run(), pytest.raises(RuntimeError, match="would run the reference.*no Triton kernel"):
        attnops.sparse_flash_mla_grad(q, ori, meta(T, 4, 64), meta(T, 4, 64), meta(1, T, 4, dtype=torch.float32),
                                      **_call_kwargs())


def test_bad_calls_fail_in_the_dry_run_before_dispatch():
    q, ori = meta(T, 4, 64), meta(BLOCKS, PAGE, 1, 64)
    with gpu_dry_run(), pytest.raises(attnops.AclnnError, match="^seqused_ori_kv"):
        attnops.sparse_flash_mla(q, ori, **{**_call_kwargs(), "seqused_ori_kv": None})


@pytest.mark.parametrize("fn", [attnops.sparse_flash_mla_metadata, attnops.sparse_flash_mla_grad_metadata])
def test_metadata_stays_on_the_device(fn):
    with gpu_dry_run() as launches:
        md = fn(64, 1, 512, cu_seqlens_q=meta(B + 1, dtype=torch.int32), seqused_ori_kv=meta(B, dtype=torch.int32),
                cmp_ratio=4, layout_q="TND", layout_kv="PA_BBND")
    assert md.device == META and md.shape == (1024,) and md.dtype == torch.int32 and not launches
