"""npu_nsa_compress_attention_infer (torch_npu_api.md §8.4): compressed attention of one new token per request over
a paged cache of compressed keys/values, and the next step's selection blocks, against the NSA golden."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops import torch_npu
from attnops.testing import golden_nsa
from attnops.testing.compare import assert_close_to_golden
from tests.helpers import randn

B, N, N2, D, DV, PAGE, BLOCKS = 3, 4, 2, 24, 16, 8, 14
CMP, STRIDE, SEL, COUNT = 32, 16, 64, 5
CMP_LENS = [40, 23, 61]  # compressed keys per request: 10, 6 and 15 selection blocks
TABLE = torch.tensor([[4, 11, 0, 7, 2, 9, 13, 5], [8, 3, 12, 6, -1, -1, -1, -1], [1, 10, 6, 2, 9, 0, 5, 3]],
                     dtype=torch.int32)
SCALE = 0.2


def _inputs(dtype, seed=0):
    return (randn(B, N, D, dtype=dtype, seed=seed), randn(BLOCKS, PAGE, N2, D, dtype=dtype, seed=seed + 1),
            randn(BLOCKS, PAGE, N2, DV, dtype=dtype, seed=seed + 2))


def _npu(q, k, v, layout="TND", **kw):
    args = dict(layout=layout, block_table=TABLE, actual_cmp_seq_kvlen=CMP_LENS)
    args.update(kw)
    return torch_npu.npu_nsa_compress_attention_infer(q, k, v, SCALE, N, N2, SEL, COUNT, PAGE, CMP, STRIDE, **args)


def _check_topk(topk, q, k, v):
    """The forced blocks first, then blocks whose golden score reaches the golden's choice (near-ties may swap:
    the golden scores in fp64)."""
    _, g_topk = golden_nsa.nsa_compress_attention_infer(q, k, v, TABLE, CMP_LENS, SCALE, CMP, STRIDE, SEL, COUNT)
    assert topk.dtype == torch.int32 and torch.equal(topk[..., :3], g_topk[..., :3])
    for b in range(B):
        for h in range(N2):
            chosen, want = topk[b, h, 3:].tolist(), g_topk[b, h, 3:].tolist()
            assert len(set(chosen)) == len(chosen) and not {0, *g_topk[b, h, 1:3].tolist()} & set(chosen)
            if chosen != want:  # only a near-tie may differ: compare the golden's scores of both choices
                scores = _golden_scores(q, k, b, h)
                assert sorted(scores[chosen], reverse=True) == pytest.approx(sorted(scores[want], reverse=True),
                                                                             rel=1e-5, abs=1e-7)


def _golden_scores(q, k, b, h):
    """The fp64 block scores of request ``b``, KV head ``h`` (the golden's formula, written out again)."""
    s2, g, m, nn = CMP_LENS[b], N // N2, SEL // STRIDE, CMP // STRIDE
    pos = torch.arange(s2)
    keys = k[TABLE[b].long()[pos // PAGE], pos % PAGE].double()  # [S2, N2, D]
    p = torch.softmax(torch.einsum("gd,ld->gl", q[b, h * g:(h + 1) * g].double(), keys[:, h]) * SCALE, -1).sum(0)
    scores = torch.zeros(s2)
    for j in range(1, s2):
        scores[j - 1] = sum(float(p[m * j - a - c]) for a in range(m) for c in range(nn) if 0 <= m * j - a - c < s2)
    return scores


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout, packed_cache", [("TND", True), ("TND", False), ("BSND", True)])
def test_compress_attention_infer_matches_golden(dtype, layout, packed_cache):
    q, k, v = _inputs(dtype)
    kk, vv = (k.flatten(-2), v.flatten(-2)) if packed_cache else (k, v)
    out, topk = _npu(q.unsqueeze(1) if layout == "BSND" else q, kk, vv, layout=layout)
    if layout == "BSND":
        assert out.shape == (B, 1, N, DV) and topk.shape == (B, 1, N2, COUNT)
        out, topk = out[:, 0], topk[:, 0]
    assert out.shape == (B, N, DV) and out.dtype == dtype and topk.shape == (B, N2, COUNT)
    g_out, _ = golden_nsa.nsa_compress_attention_infer(q, k, v, TABLE, CMP_LENS, SCALE, CMP, STRIDE, SEL, COUNT)
    b_out, _ = golden_nsa.nsa_compress_attention_infer(q, k, v, TABLE, CMP_LENS, SCALE, CMP, STRIDE, SEL, COUNT,
                                                       dtype=dtype)
    assert_close_to_golden("attention_out", out, g_out, b_out, reduction=D + max(CMP_LENS))
    _check_topk(topk, q, k, v)


def test_compress_attention_infer_topk_follows_the_probabilities():
    """Raising one compressed key's score moves the blocks that cover it to the front of the ranked part."""
    q, k, v = _inputs(torch.float32, seed=3)
    k2 = k.clone()
    k2[TABLE[2, 40 // PAGE], 40 % PAGE, 1] = q[2, 2:].mean(0) * 40  # request 2, KV head 1, compressed key 40
    _, topk = _npu(q, k2, v)
    covering = {j - 1 for j in range(1, CMP_LENS[2]) for a in range(SEL // STRIDE) for c in range(CMP // STRIDE)
                if (SEL // STRIDE) * j - a - c == 40}  # blocks 9 and 10
    assert covering <= set(topk[2, 1, 3:5].tolist())


def test_pythonic_nsa_compress_attention_infer_is_the_same_operator():
    q, k, v = _inputs(torch.float32, seed=5)
    out, topk = attnops.nsa_compress_attention_infer(q, k, v, TABLE, CMP_LENS, compress_block_size=CMP,
                                                     compress_stride=STRIDE, select_block_size=SEL,
                                                     select_block_count=COUNT, scale=SCALE)
    npu_out, npu_topk = _npu(q, k, v)
    assert torch.equal(out, npu_out) and torch.equal(topk, npu_topk)


@pytest.mark.parametrize("change, argument", [
    (dict(lens=[40, 23, 3]), r"actual_cmp_seq_kvlen\[2\]"),  # 3 compressed keys: 2 selection blocks < 5
    (dict(lens=[40, 23]), "actual_cmp_seq_kvlen"),
    (dict(count=2), "select_block_count"),
    (dict(sel=40), "select_block_size"),
    (dict(stride=12), "compress_block_size"),
    (dict(table=TABLE.clone().index_fill_(1, torch.tensor([1]), -3)), "block_table"),
    (dict(layout="BSH"), "layout"),
])
def test_compress_attention_infer_errors_name_the_argument(change, argument):
    q, k, v = _inputs(torch.float16)
    with pytest.raises(ValueError, match=argument):
        torch_npu.npu_nsa_compress_attention_infer(
            q, k, v, SCALE, N, N2, change.get("sel", SEL), change.get("count", COUNT), PAGE, CMP,
            change.get("stride", STRIDE), layout=change.get("layout", "TND"), block_table=change.get("table", TABLE),
            actual_cmp_seq_kvlen=change.get("lens", CMP_LENS))


@pytest.mark.parametrize("argument", ["atten_mask", "topk_mask", "actual_seq_qlen", "actual_sel_seq_kvlen"])
def test_compress_attention_infer_unsupported_arguments(argument):
    q, k, v = _inputs(torch.float16)
    with pytest.raises(NotImplementedError, match=argument):
        _npu(q, k, v, **{argument: torch.ones(1)})


def test_opcheck_nsa_compress_attention_infer():
    q, k, v = _inputs(torch.float32, seed=7)
    torch.library.opcheck(torch.ops.attnops.nsa_compress_attention_infer.default,
                          (q, k, v, TABLE, SCALE, N, N2, SEL, COUNT, PAGE, CMP, STRIDE, CMP_LENS))


# ----------------------------------------------------------------------------------- npu_nsa_compress_infer.cache
@pytest.mark.parametrize("lens", [[48, 40, 32, 56], [43, 16, 33, 64]])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_compress_infer_cache_matches_golden(lens, dtype):
    """Blocks of 32 keys with stride 8 over 16-key pages: a request writes its slot when its length ends a block
    (48, 40, 32, 56, 64), whose keys span two or three pages, and leaves it alone otherwise (43, 16, 33)."""
    kv, w = randn(12, 16, 2, 24, dtype=dtype, seed=20), randn(32, 2, dtype=dtype, seed=21) / 32
    table = torch.tensor([[3, 7, 0, 9], [5, 1, 11, 2], [8, 4, 6, 10], [2, 9, 7, 3]], dtype=torch.int32)
    slots = torch.tensor([4, 0, 2, 5])
    cache = randn(6, 2, 24, dtype=dtype, seed=22)
    before = cache.clone()
    result = torch_npu.npu_nsa_compress_infer(kv, w, slots, 32, 8, 16, block_table=table, actual_seq_len=lens,
                                              cache=cache)
    assert result is cache
    golden = golden_nsa.nsa_compress_infer_cache(kv, w, slots, table, lens, 32, 8, before)
    base = golden_nsa.nsa_compress_infer_cache(kv, w, slots, table, lens, 32, 8, before, dtype=dtype)
    assert_close_to_golden("cache", cache, golden, base, reduction=32)  # one block of 32 keys
    for b, n in enumerate(lens):
        if n < 32 or (n - 32) % 8:
            assert torch.equal(cache[slots[b]], before[slots[b]])
    untouched = [r for r in range(6) if r not in slots.tolist()]
    assert torch.equal(cache[untouched], before[untouched])


def test_compress_infer_cache_packed_input_and_errors():
    kv, w = randn(4, 8, 2, 16, seed=23), randn(4, 2, seed=24)
    table, slots = torch.tensor([[2, 0], [3, 1]]), torch.tensor([1, 0])
    a, b = torch.zeros(3, 2, 16), torch.zeros(3, 2, 16)
    kw = dict(block_table=table, actual_seq_len=[10, 8])
    torch_npu.npu_nsa_compress_infer(kv, w, slots, 4, 2, 8, cache=a, **kw)
    torch_npu.npu_nsa_compress_infer.cache(kv.flatten(-2), w, slots, 4, 2, 8, cache=b, **kw)
    assert torch.equal(a, b) and a.abs().sum() > 0
    with pytest.raises(ValueError, match=r"slot_mapping\[0\]"):
        torch_npu.npu_nsa_compress_infer(kv, w, torch.tensor([3, 0]), 4, 2, 8, cache=a, **kw)
    with pytest.raises(ValueError, match="page_block_size"):
        torch_npu.npu_nsa_compress_infer(kv, w, slots, 4, 2, 4, cache=a, **kw)
    with pytest.raises(ValueError, match="cache"):
        torch_npu.npu_nsa_compress_infer(kv, w, slots, 4, 2, 8, cache=torch.zeros(3, 2, 8), **kw)
    with pytest.raises(ValueError, match="weight"):
        torch_npu.npu_nsa_compress_infer(kv, w[:3], slots, 4, 2, 8, cache=a, **kw)
    with pytest.raises(ValueError, match="block_table"):
        torch_npu.npu_nsa_compress_infer(kv, w, slots, 4, 2, 8, cache=a, actual_seq_len=[10, 8])


def test_opcheck_nsa_compress_infer():
    kv, w = randn(4, 8, 2, 16, seed=25), randn(4, 2, seed=26)
    torch.library.opcheck(torch.ops.attnops.nsa_compress_infer.default,
                          (kv, w, torch.tensor([1, 0]), torch.tensor([[2, 0], [3, 1]]), torch.zeros(3, 2, 16), 4, 2,
                           8, [10, 8]))
