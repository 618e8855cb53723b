"""DeepSeek-V4 sparse flash MLA on the GPU hot path, checked without a GPU inside
:func:`attnops.testing.gpu_dry_run` (``meta`` tensors, where any host read of a device value, blocking upload or
tensor built on the host raises): ``sparse_flash_mla`` records its Triton launches (prefill, or the decode split and
its combine) with lengths, tables and indices on the device or given on the host; ``sparse_flash_mla_grad`` (no
kernel) raises saying it would run the reference, after validating without reading a device value;
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


def kernels(launches) -> list[str]:
    return [record.kernel for record in launches]


def test_attention_runs_its_kernel_on_device_metadata_and_grad_says_it_has_none():
    q, ori = meta(T, 4, 64), meta(BLOCKS, PAGE, 1, 64)
    with gpu_dry_run() as launches:
        out, lse = attnops.sparse_flash_mla(q, ori, **_call_kwargs())
    assert kernels(launches) == ["sparse_flash_mla_kernel"] and launches[0].grid == (T, 1)
    assert out.shape == q.shape and lse.shape == (1, T, 4) and lse.dtype == torch.float32
    with gpu_dry_run(), pytest.raises(RuntimeError, match="would run the reference.*no Triton kernel"):
        attnops.sparse_flash_mla_grad(q, ori, meta(T, 4, 64), meta(T, 4, 64), meta(1, T, 4, dtype=torch.float32),
                                      **_call_kwargs())


@pytest.mark.parametrize("sparse", [True, False], ids=["csa", "hca"])
def test_prefill_with_host_lengths_at_dsv4_shapes(sparse):
    """BSND prefill, 128 heads x 512 columns (two head tiles of 64 x two column tiles of 256), lengths given as host
    lists (uploaded without blocking), indices on the device."""
    b, s, heads = 2, 64, 128
    extra = dict(cmp_sparse_indices=meta(b, s, 1, 512, dtype=torch.int32)) if sparse else {}
    with gpu_dry_run() as launches:
        attnops.sparse_flash_mla(meta(b, s, heads, 512), meta(b, s, 1, 512), cmp_kv=meta(b, s // 4, 1, 512),
                                 cmp_ratio=4, sinks=meta(heads, dtype=torch.float32), seqused_q=[64, 30],
                                 seqused_ori_kv=[64, 40], seqused_cmp_kv=[16, 10], cmp_residual_kv=[0, 0], **extra)
    assert kernels(launches) == ["sparse_flash_mla_kernel"] and launches[0].grid == (b * s, 4)
    assert launches[0].constexprs["SPARSE"] == sparse and launches[0].constexprs["BLOCK_DV"] == 256


def test_decode_splits_over_a_paged_cache_with_device_metadata():
    """vLLM's decode step: one token per request (TND) over paged caches, every length, table and index on the
    device: each row's key stream is split over programs, then combined."""
    requests, heads = 4, 64
    i32 = torch.int32
    with gpu_dry_run() as launches:
        attnops.sparse_flash_mla(meta(requests, heads, 512), meta(64, 64, 1, 512), cmp_kv=meta(64, 64, 1, 512),
                                 cmp_sparse_indices=meta(requests, 1, 1024, dtype=i32), cmp_ratio=4,
                                 layout_q="TND", layout_kv="PA_BBND", ori_block_table=meta(requests, 16, dtype=i32),
                                 cmp_block_table=meta(requests, 16, dtype=i32),
                                 cu_seqlens_q=meta(requests + 1, dtype=i32), seqused_ori_kv=meta(requests, dtype=i32),
                                 cmp_residual_kv=meta(requests, dtype=i32))
    assert kernels(launches) == ["sparse_flash_mla_split_kernel", "sparse_flash_mla_combine_kernel"]
    assert launches[1].grid == (requests, 4)  # 64 heads x 512 columns: four column tiles of 128
    assert launches[0].grid[0] == requests and launches[0].grid[1] > 4 and launches[0].grid[1] % 4 == 0


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
