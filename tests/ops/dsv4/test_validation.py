"""The validation table: each bad argument of a valid call raises an attnops error naming it, before any compute."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.ops.dsv4 import reference

from .helpers import call, hca, make_parts, pack


def _valid(layout_q="TND", layout_kv="PA_BBND"):
    case = hca([3, 5], [7, 9], ratio=2, topk=3, dtype=torch.float32, dim=8, heads=2)
    kw, _ = pack(case, make_parts(case), layout_q, layout_kv)
    return kw


def _set(**changes):
    return lambda kw: kw.update(changes)


def _tensor(name, fn):
    return lambda kw: kw.update({name: fn(kw[name])})


I32 = torch.int32
TND_PA = [
    ("q dtype", _tensor("q", lambda x: x.to(torch.int32)), "q"),
    ("q rank", _tensor("q", lambda x: x[None]), "q"),
    ("q empty head dim", _tensor("q", lambda x: x[..., :0]), "q"),
    ("ori_kv dtype", _tensor("ori_kv", lambda x: x.double()), "ori_kv"),
    ("ori_kv heads", _tensor("ori_kv", lambda x: x.expand(-1, -1, 2, -1)), "ori_kv"),
    ("ori_kv head dim", _tensor("ori_kv", lambda x: x[..., :4]), "ori_kv"),
    ("ori_kv device", _tensor("ori_kv", lambda x: x.to("meta")), "ori_kv"),
    ("ori_kv missing", _set(ori_kv=None), "ori_kv"),
    ("cmp_kv dtype", _tensor("cmp_kv", lambda x: x.half()), "cmp_kv"),
    ("layout_q", _set(layout_q="BNSD"), "layout_q"),
    ("layout_kv", _set(layout_kv="PA_BSND"), "layout_kv"),
    ("cmp_ratio 0", _set(cmp_ratio=0), "cmp_ratio"),
    ("cmp_ratio 129", _set(cmp_ratio=129), "cmp_ratio"),
    ("cmp_ratio float", _set(cmp_ratio=4.0), "cmp_ratio"),
    ("ori_mask_mode", _set(ori_mask_mode=1), "ori_mask_mode"),
    ("cmp_mask_mode", _set(cmp_mask_mode=4), "cmp_mask_mode"),
    ("ori_win_left", _set(ori_win_left=-2), "ori_win_left"),
    ("ori_win_right", _set(ori_win_right=-5), "ori_win_right"),
    ("scale nan", _set(scale=float("nan")), "scale"),
    ("cu_seqlens_q missing", _set(cu_seqlens_q=None), "cu_seqlens_q"),
    ("cu_seqlens_q decreasing", _set(cu_seqlens_q=torch.tensor([0, 5, 3], dtype=I32)), "cu_seqlens_q"),
    ("cu_seqlens_q no leading 0", _set(cu_seqlens_q=torch.tensor([1, 3, 8], dtype=I32)), "cu_seqlens_q"),
    ("cu_seqlens_q past T", _set(cu_seqlens_q=torch.tensor([0, 3, 9], dtype=I32)), "cu_seqlens_q"),
    ("cu_seqlens_q device", _tensor("cu_seqlens_q", lambda x: x.to("meta")), "cu_seqlens_q"),
    ("cu_seqlens_q float", _set(cu_seqlens_q=torch.tensor([0.0, 3.0, 8.0])), "cu_seqlens_q"),
    ("cu_seqlens_ori_kv with PA", _set(cu_seqlens_ori_kv=torch.tensor([0, 7, 16], dtype=I32)), "cu_seqlens_ori_kv"),
    ("seqused_ori_kv missing with PA", _set(seqused_ori_kv=None), "seqused_ori_kv"),
    ("seqused_ori_kv past the blocks", _set(seqused_ori_kv=torch.tensor([7, 99], dtype=I32)), "seqused_ori_kv"),
    ("seqused_ori_kv negative", _set(seqused_ori_kv=torch.tensor([-1, 9], dtype=I32)), "seqused_ori_kv"),
    ("seqused_q batch", _set(seqused_q=torch.tensor([3], dtype=I32)), "seqused_q"),
    ("seqused_q too long", _set(seqused_q=torch.tensor([4, 5], dtype=I32)), "seqused_q"),
    ("ori_block_table batch", _tensor("ori_block_table", lambda x: x[:1]), "ori_block_table"),
    ("ori_block_table missing", _set(ori_block_table=None), "ori_block_table"),
    ("ori_block_table dtype", _tensor("ori_block_table", lambda x: x.float()), "ori_block_table"),
    ("ori_block_table id out of range", _tensor("ori_block_table", lambda x: x.masked_fill(x == x.max(), 99)),
     "ori_block_table"),
    ("ori_block_table -1 in use", _tensor("ori_block_table", lambda x: torch.cat([x[:, :1].fill_(-1), x[:, 1:]], 1)),
     "ori_block_table"),
    ("cmp_block_table missing", _set(cmp_block_table=None), "cmp_block_table"),
    ("cmp_sparse_indices dtype", _tensor("cmp_sparse_indices", lambda x: x.float()), "cmp_sparse_indices"),
    ("cmp_sparse_indices shape", _tensor("cmp_sparse_indices", lambda x: x[:-1]), "cmp_sparse_indices"),
    ("cmp_sparse_indices two heads", _tensor("cmp_sparse_indices", lambda x: x.expand(-1, 2, -1)),
     "cmp_sparse_indices"),
    ("cmp_sparse_indices past Lcmp", _tensor("cmp_sparse_indices", lambda x: x.masked_fill(x == -1, 4)),
     "cmp_sparse_indices"),
    ("cmp_sparse_indices below -1", _tensor("cmp_sparse_indices", lambda x: x.masked_fill(x == -1, -2)),
     "cmp_sparse_indices"),
    ("cmp_residual_kv >= ratio", _set(cmp_residual_kv=torch.tensor([2, 0], dtype=I32)), "cmp_residual_kv"),
    ("cmp_residual_kv batch", _set(cmp_residual_kv=torch.tensor([1, 0, 0], dtype=I32)), "cmp_residual_kv"),
    ("sinks shape", _tensor("sinks", lambda x: x[:1]), "sinks"),
    ("sinks dtype", _tensor("sinks", lambda x: x.bfloat16()), "sinks"),
    ("cmp indices without cmp_kv", _set(cmp_kv=None, cmp_block_table=None, seqused_cmp_kv=None),
     "cmp_sparse_indices"),
    ("seqused_cmp_kv without cmp_kv", _set(cmp_kv=None, cmp_block_table=None, cmp_sparse_indices=None),
     "seqused_cmp_kv"),
]
BSND = [
    ("layout pair", _set(layout_kv="TND"), "layout_kv"),
    ("ori_kv batch", _tensor("ori_kv", lambda x: x[:1]), "ori_kv"),
    ("cu_seqlens_q with BSND", _set(cu_seqlens_q=torch.tensor([0, 3, 8], dtype=I32)), "cu_seqlens_q"),
    ("block table with BSND", _set(ori_block_table=torch.zeros(2, 2, dtype=I32)), "ori_block_table"),
    ("seqused_cmp_kv past S3", _set(seqused_cmp_kv=torch.tensor([3, 9], dtype=I32)), "seqused_cmp_kv"),
]
TND = [
    ("cu_seqlens_ori_kv missing", _set(cu_seqlens_ori_kv=None), "cu_seqlens_ori_kv"),
    ("cu_seqlens_cmp_kv batch", _set(cu_seqlens_cmp_kv=torch.tensor([0, 3], dtype=I32)), "cu_seqlens_cmp_kv"),
    ("cu_seqlens_ori_kv past T2", _set(cu_seqlens_ori_kv=torch.tensor([0, 7, 17], dtype=I32)), "cu_seqlens_ori_kv"),
]


@pytest.mark.parametrize("layouts, mutate, name", [
    *[pytest.param(("TND", "PA_BBND"), m, n, id=i) for i, m, n in TND_PA],
    *[pytest.param(("BSND", "BSND"), m, n, id=i) for i, m, n in BSND],
    *[pytest.param(("TND", "TND"), m, n, id=i) for i, m, n in TND],
])
def test_bad_argument_is_named(layouts, mutate, name, monkeypatch):
    kw = _valid(*layouts)
    call(kw)  # the valid call runs
    mutate(kw)

    def no_compute(*args, **kwargs):
        raise AssertionError("computed before validating")

    monkeypatch.setattr(reference, "_chunk_keys", no_compute)
    with pytest.raises(attnops.AclnnError, match=f"^{name}: expected"):
        call(kw)


def test_grad_inputs_are_checked():
    kw = _valid()
    out, lse = call(kw)
    q, ori = kw.pop("q"), kw.pop("ori_kv")
    with pytest.raises(attnops.AclnnError, match="^d_out|^dout"):
        attnops.sparse_flash_mla_grad(q, ori, out[:-1], out, lse, **kw)
    with pytest.raises(attnops.AclnnError, match="^softmax_lse"):
        attnops.sparse_flash_mla_grad(q, ori, out, out, lse[..., :1], **kw)
    with pytest.raises(attnops.AclnnError, match="^d_softmax_lse"):
        attnops.sparse_flash_mla_grad(q, ori, out, out, lse, d_softmax_lse=lse.double(), **kw)


def test_lists_are_accepted_for_lengths():
    kw = _valid("TND", "TND")
    ref = call(kw)
    lists = {k: v.tolist() for k, v in kw.items() if k.startswith(("cu_seqlens", "seqused", "cmp_residual"))}
    torch.testing.assert_close(call({**kw, **lists}), ref, rtol=0, atol=0)
