"""npu_nsa_select_attention_infer (torch_npu_api.md §8.4): selected attention of one new token per request over a
paged KV cache, against the NSA golden."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops import torch_npu
from attnops.testing import golden_nsa
from attnops.testing.compare import assert_close_to_golden
from tests.helpers import randn

B, N, N2, D, DV, PAGE, BLOCK, COUNT, BLOCKS = 3, 4, 2, 16, 8, 4, 8, 3, 12
KV_LENS = [21, 9, 16]  # 21: a last block of 5 keys; 16 = two whole blocks
TABLE = torch.tensor([[7, 2, 9, 0, 4, 11], [3, 10, 5, -1, -1, -1], [1, 8, 6, 5, -1, -1]], dtype=torch.int32)
TOPK = torch.tensor([[[2, 0, -1], [1, 2, 0]],       # head 1: all three blocks, in a shuffled order
                     [[1, 1, 0], [-1, 0, 1]],       # a repeated block; a row that selects nothing
                     [[0, -1, 1], [1, 0, -1]]], dtype=torch.int32)  # entries after the first -1 are ignored
REDUCTION = D + TOPK.shape[-1] * BLOCK  # the scores over D, then P V over the selected blocks' keys


def _inputs(dtype, seed=0):
    q = randn(B, N, D, dtype=dtype, seed=seed)
    return q, randn(BLOCKS, PAGE, N2, D, dtype=dtype, seed=seed + 1), randn(BLOCKS, PAGE, N2, DV, dtype=dtype,
                                                                            seed=seed + 2)


def _layout(q, k, v, layout, packed_cache):
    if packed_cache:
        k, v = k.flatten(-2), v.flatten(-2)
    if layout == "BSH":
        return q.flatten(-2).unsqueeze(1), k, v
    return (q.unsqueeze(1), k, v) if layout == "BSND" else (q, k, v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout, packed_cache", [("BSND", False), ("BSH", True), ("TND", True), ("TND", False)])
def test_select_attention_infer_matches_golden(dtype, layout, packed_cache):
    q, k, v = _inputs(dtype)
    out = torch_npu.npu_nsa_select_attention_infer(*_layout(q, k, v, layout, packed_cache), TOPK, 0.3, N, N2, BLOCK,
                                                   COUNT, PAGE, layout=layout, block_table=TABLE,
                                                   actual_seq_kvlen=KV_LENS)
    want = {"BSH": (B, 1, N * DV), "BSND": (B, 1, N, DV), "TND": (B, N, DV)}[layout]
    assert out.shape == want and out.dtype == dtype
    golden = golden_nsa.nsa_select_attention_infer(q, k, v, TOPK, TABLE, KV_LENS, 0.3, BLOCK)
    baseline = golden_nsa.nsa_select_attention_infer(q, k, v, TOPK, TABLE, KV_LENS, 0.3, BLOCK, dtype=dtype)
    assert_close_to_golden("attention_out", out.reshape(B, N, DV), golden, baseline, reduction=REDUCTION)
    assert torch.equal(out.reshape(B, N, DV)[1, 2:], torch.zeros(2, DV, dtype=dtype))  # selected nothing


def test_select_attention_infer_uses_only_the_selected_blocks():
    q, k, v = _inputs(torch.float32, seed=5)
    kw = dict(layout="TND", block_table=TABLE, actual_seq_kvlen=KV_LENS)
    base = torch_npu.npu_nsa_select_attention_infer(q, k, v, TOPK, 0.3, N, N2, BLOCK, COUNT, PAGE, **kw)
    k2, v2 = k.clone(), v.clone()
    k2[TABLE[0, 2], 1:] += 5  # request 0, positions 9..11 (block 1): KV head 1 selects it, KV head 0 does not
    v2[TABLE[0, 2], 1:] -= 5
    other = torch_npu.npu_nsa_select_attention_infer(q, k2, v2, TOPK, 0.3, N, N2, BLOCK, COUNT, PAGE, **kw)
    assert torch.equal(base[0, :2], other[0, :2]) and not torch.equal(base[0, 2:], other[0, 2:])


@pytest.mark.parametrize("change, argument", [
    (dict(topk=torch.tensor([[[3, -1, -1]] * 2] * 3, dtype=torch.int32)), "topk_indices"),  # 3 >= ceil(21/8)
    (dict(topk=torch.tensor([[[-2, -1, -1]] * 2] * 3, dtype=torch.int32)), "topk_indices"),
    (dict(table=TABLE.clone().index_fill_(1, torch.tensor([0]), 12)), "block_table"),
    (dict(lens=[21, 9]), "actual_seq_kvlen"),
    (dict(lens=[25, 9, 16]), "actual_seq_kvlen[0]"),  # more than the table's 6 pages of 4
    (dict(scale_heads=3), "head_num"),
    (dict(kv_heads=3), "key_value_head_num"),
    (dict(page=8), "key"),
    (dict(layout="BNSD"), "layout"),
    (dict(table=None), "block_table"),
])
def test_select_attention_infer_errors_name_the_argument(change, argument):
    q, k, v = _inputs(torch.float16)
    kw = dict(layout=change.get("layout", "TND"), block_table=change.get("table", TABLE),
              actual_seq_kvlen=change.get("lens", KV_LENS))
    with pytest.raises(ValueError, match=argument.replace("[", r"\[").replace("]", r"\]")):
        torch_npu.npu_nsa_select_attention_infer(q, k, v, change.get("topk", TOPK), 0.3, change.get("scale_heads", N),
                                                 change.get("kv_heads", N2), BLOCK, COUNT, change.get("page", PAGE),
                                                 **kw)


@pytest.mark.parametrize("argument", ["atten_mask", "actual_seq_qlen"])
def test_select_attention_infer_unsupported_arguments(argument):
    q, k, v = _inputs(torch.float16)
    with pytest.raises(NotImplementedError, match=argument):
        torch_npu.npu_nsa_select_attention_infer(q, k, v, TOPK, 0.3, N, N2, BLOCK, COUNT, PAGE, layout="TND",
                                                 block_table=TABLE, actual_seq_kvlen=KV_LENS,
                                                 **{argument: torch.ones(1)})


def test_opcheck_nsa_selected_attention_infer():
    q, k, v = _inputs(torch.float32, seed=7)
    torch.library.opcheck(torch.ops.attnops.nsa_selected_attention_infer.default,
                          (q, k, v, TOPK, TABLE, 0.3, N, N2, BLOCK, COUNT, PAGE, KV_LENS))


def test_pythonic_nsa_selected_attention_infer_is_the_same_operator():
    q, k, v = _inputs(torch.float32, seed=9)
    out = attnops.nsa_selected_attention_infer(q, k, v, TOPK, TABLE, torch.tensor(KV_LENS), select_block_size=BLOCK)
    golden = golden_nsa.nsa_select_attention_infer(q, k, v, TOPK, TABLE, KV_LENS, D ** -0.5, BLOCK)
    baseline = golden_nsa.nsa_select_attention_infer(q, k, v, TOPK, TABLE, KV_LENS, D ** -0.5, BLOCK,
                                                     dtype=torch.float32)
    assert_close_to_golden("attention_out", out, golden, baseline, reduction=REDUCTION)
    npu = torch_npu.npu_nsa_select_attention_infer(q, k, v, TOPK, D ** -0.5, N, N2, BLOCK, COUNT, PAGE, layout="TND",
                                                   block_table=TABLE, actual_seq_kvlen=KV_LENS)
    assert torch.equal(out, npu)
