"""sparse_flash_mla_metadata / sparse_flash_mla_grad_metadata: the documented int32 [1024] tensor, argument checks."""
from __future__ import annotations

import pytest
import torch

import attnops

I32 = torch.int32


@pytest.mark.parametrize("fn", [attnops.sparse_flash_mla_metadata, attnops.sparse_flash_mla_grad_metadata])
def test_result_is_int32_zeros(fn):
    md = fn(64, 1, 512, cu_seqlens_q=torch.tensor([0, 3, 8], dtype=I32), seqused_ori_kv=torch.tensor([9, 17]),
            cmp_residual_kv=torch.tensor([1, 1], dtype=I32), batch_size=2, max_seqlen_q=5, cmp_topk=512, cmp_ratio=4,
            ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=127, ori_win_right=0, layout_q="TND",
            layout_kv="PA_BBND", has_ori_kv=True, has_cmp_kv=True)
    assert md.shape == (1024,) and md.dtype == I32 and md.device.type == "cpu" and not md.any()
    assert torch.equal(fn(1, 1, 1), md)


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_heads_q=0), "num_heads_q"),
    (dict(num_heads_kv=2), "num_heads_kv"),
    (dict(head_dim=0), "head_dim"),
    (dict(cu_seqlens_q=torch.tensor([0, 3], dtype=I32), seqused_q=torch.tensor([1, 2], dtype=I32)), "seqused_q"),
    (dict(batch_size=3, seqused_ori_kv=torch.tensor([1, 2], dtype=I32)), "seqused_ori_kv"),
    (dict(cu_seqlens_q=torch.tensor([0.0, 3.0])), "cu_seqlens_q"),
    (dict(cmp_residual_kv=torch.zeros(2, 2, dtype=I32)), "cmp_residual_kv"),
    (dict(ori_topk_length=torch.zeros(2, dtype=I32)), "ori_topk_length"),
    (dict(cmp_topk_length=torch.zeros(2, dtype=I32)), "cmp_topk_length"),
    (dict(batch_size=-1), "batch_size"),
    (dict(max_seqlen_q=-1), "max_seqlen_q"),
    (dict(cmp_topk=-1), "cmp_topk"),
    (dict(cmp_ratio=0), "cmp_ratio"),
    (dict(ori_mask_mode=2), "ori_mask_mode"),
    (dict(cmp_mask_mode=4), "cmp_mask_mode"),
    (dict(ori_win_left=-3), "ori_win_left"),
    (dict(layout_q="BSH"), "layout_q"),
    (dict(layout_kv="PA_ND"), "layout_kv"),
    (dict(has_cmp_kv="yes"), "has_cmp_kv"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_argument_is_named(kwargs, name):
    args = {"num_heads_q": 64, "num_heads_kv": 1, "head_dim": 512}
    positional = [kwargs.pop(k, args[k]) for k in args]
    with pytest.raises(attnops.AclnnError, match=f"^{name}: expected"):
        attnops.sparse_flash_mla_metadata(*positional, **kwargs)


def test_traces_under_compile():
    def fn(cu):
        return attnops.sparse_flash_mla_metadata(64, 1, 512, cu_seqlens_q=cu, cmp_ratio=4) + cu.sum()

    cu = torch.tensor([0, 3, 8], dtype=I32)
    assert torch.equal(torch.compile(fn, fullgraph=True, backend="eager")(cu), fn(cu))
