"""NSA decode on the device paths (selected and compressed attention kernels over shuffled paged caches,
compression into the cache) vs the fp64 golden, with the project's tolerance rule."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops import ParamInvalidError
from attnops import torch_npu
from attnops.ops.nsa.triton import infer_launch
from attnops.ops.nsa.triton.verify import decode_reason
from attnops.testing import golden_nsa as G
from attnops.testing.compare import assert_close_to_golden

from ..nsa_helpers import baseline_dtype, randn
from .conftest import DEVICE

PAGE = 8


def _paged(lens, n1, n2, d, dv, dtype, *, seed=0):
    """Query ``[B, N1, D]``, caches with shuffled pages, the block table (-1 past each request's pages)."""
    pages = [-(-n // PAGE) for n in lens]
    blocks = sum(pages) + 2
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.full((len(lens), max(pages)), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = torch.tensor(order[used:used + n], dtype=torch.int32)
        used += n
    q = randn(len(lens), n1, d, dtype=dtype, seed=seed)
    k = randn(blocks, PAGE, n2, d, dtype=dtype, seed=seed + 1)
    v = randn(blocks, PAGE, n2, dv, dtype=dtype, seed=seed + 2)
    return q, k, v, table


def _dev(*xs):
    return [x.to(DEVICE) for x in xs]


@pytest.mark.parametrize("g,d,dv,dtype,programs", [(1, 16, 16, torch.float32, None), (2, 16, 8, torch.float16, None),
                                                   (4, 8, 8, torch.float32, 1), (16, 192, 128, torch.float16, None)])
def test_selected_attention_infer(triton_backend, monkeypatch, g, d, dv, dtype, programs):
    """Padding (-1, later indices ignored, also when the -1 is in an earlier split), a repeated block, a block cut
    at the length, a head selecting nothing; split over the slots (one slot per split at these sizes, merged by
    ``decode_merge_kernel``) or, with ``programs`` = 1, one program per (request, KV head)."""
    if programs is not None:
        monkeypatch.setattr(infer_launch, "DECODE_PROGRAMS", programs)
    lens, n2, block = [37, 20, 9], 2 if g < 16 else 1, 16
    q, k, v, table = _paged(lens, n2 * g, n2, d, dv, dtype, seed=g)
    topk = torch.tensor([[[2, 0, -1, 1], [1, 1, 0, 2]], [[0, 1, -1, -1], [-1, 0, 1, 0]],
                         [[0, -1, -1, -1], [0, 0, 0, 0]]], dtype=torch.int32)[:, :n2]
    scale = d ** -0.5
    out = attnops.nsa_selected_attention_infer(*_dev(q, k, v, topk, table), lens, select_block_size=block,
                                               scale=scale)
    golden = G.nsa_select_attention_infer(q, k, v, topk, table, lens, scale, block)
    base = G.nsa_select_attention_infer(q, k, v, topk, table, lens, scale, block, dtype=baseline_dtype(dtype))
    assert out.shape == golden.shape and out.dtype == dtype
    assert_close_to_golden("selected_infer.out", out.cpu(), golden, base, factor=2,
                           reduction=d + topk.shape[-1] * block)  # the scores over D, P V over the selected keys
    if n2 == 2:
        assert bool((out[1, g:2 * g] == 0).all())  # request 1, KV head 1: -1 first, nothing selected
    assert triton_backend == ["selected_decode_kernel"] + (["decode_merge_kernel"] if programs is None else [])


def _golden_scores(q, k, table, s2, b, h, g, m, nn, scale):
    pos = torch.arange(s2)
    keys = k[table[b].long()[pos // PAGE], pos % PAGE].double()
    p = torch.softmax(torch.einsum("gd,ld->gl", q[b, h * g:(h + 1) * g].double(), keys[:, h]) * scale, -1).sum(0)
    scores = torch.zeros(max(s2, 1), dtype=torch.float64)
    for j in range(1, s2):
        scores[j - 1] = sum(float(p[m * j - a - c]) for a in range(m) for c in range(nn) if 0 <= m * j - a - c < s2)
    return scores


@pytest.mark.parametrize("g,d,dv,dtype", [(1, 16, 16, torch.float32), (2, 16, 8, torch.float16),
                                          (4, 8, 8, torch.float32), (16, 192, 128, torch.float16)])
def test_compress_attention_infer(triton_backend, g, d, dv, dtype):
    lens, n2, cmp, stride, sel, count = [40, 23, 61], 2 if g < 16 else 1, 32, 16, 64, 5
    q, k, v, table = _paged(lens, n2 * g, n2, d, dv, dtype, seed=10 + g)
    scale = d ** -0.5
    out, topk = attnops.nsa_compress_attention_infer(*_dev(q, k, v, table), lens, compress_block_size=cmp,
                                                     compress_stride=stride, select_block_size=sel,
                                                     select_block_count=count, scale=scale)
    args = (q, k, v, table, lens, scale, cmp, stride, sel, count)
    g_out, g_topk = G.nsa_compress_attention_infer(*args)
    b_out, _ = G.nsa_compress_attention_infer(*args, dtype=baseline_dtype(dtype))
    assert_close_to_golden("compress_infer.out", out.cpu(), g_out, b_out, factor=2, reduction=d + max(lens))
    topk = topk.cpu()
    assert topk.dtype == torch.int32 and torch.equal(topk[..., :3], g_topk[..., :3])
    for b, s2 in enumerate(lens):
        for h in range(n2):
            chosen, want = topk[b, h, 3:].tolist(), g_topk[b, h, 3:].tolist()
            assert len(set(topk[b, h].tolist())) == count
            if chosen != want:  # only a near-tie may swap (the golden scores in fp64)
                scores = _golden_scores(q, k, table, s2, b, h, g, sel // stride, cmp // stride, scale)
                assert scores[chosen].tolist() == pytest.approx(scores[want].tolist(), rel=1e-4, abs=1e-6)
    assert triton_backend == ["compress_decode_kernel", "compress_decode_score_kernel", "topk_kernel"]


def test_compress_attention_infer_ties_go_to_the_lower_block(triton_backend):
    """A zero query: uniform probabilities, every full middle block scores the same, the lower ones win."""
    lens = [61]
    q, k, v, table = _paged(lens, 2, 1, 16, 16, torch.float32, seed=3)
    _, topk = attnops.nsa_compress_attention_infer(*_dev(torch.zeros_like(q), k, v, table), lens,
                                                   compress_block_size=32, compress_stride=16, select_block_size=64,
                                                   select_block_count=6, scale=0.25)
    assert topk[0, 0].tolist() == [0, 14, 15, 1, 2, 3]


@pytest.mark.parametrize("lens", [[48, 40, 32, 56], [43, 16, 33, 64]])
def test_compress_infer_cache(triton_backend, monkeypatch, lens):
    """Requests ending a block (32 keys, stride 8, over shuffled 16-key pages) write their slot, others do not."""
    calls = []
    device_path = infer_launch.compress_into_cache
    monkeypatch.setattr(infer_launch, "compress_into_cache", lambda *a: calls.append(1) or device_path(*a))
    kv, w = randn(12, 16, 2, 24, seed=20), randn(32, 2, seed=21) / 32
    table = torch.tensor([[3, 7, 0, 9], [5, 1, 11, 2], [8, 4, 6, 10], [2, 9, 7, 3]], dtype=torch.int32)
    slots = torch.tensor([4, 0, 2, 5])
    cache = randn(6, 2, 24, seed=22)
    golden = G.nsa_compress_infer_cache(kv, w, slots, table, lens, 32, 8, cache)
    base = G.nsa_compress_infer_cache(kv, w, slots, table, lens, 32, 8, cache, dtype=torch.float32)
    dev_cache = cache.to(DEVICE)
    torch_npu.npu_nsa_compress_infer(*_dev(kv, w, slots), 32, 8, 16, block_table=table.to(DEVICE),
                                     actual_seq_len=lens, cache=dev_cache)
    assert_close_to_golden("compress_infer.cache", dev_cache.cpu(), golden, base, factor=2, reduction=32)  # one block
    assert triton_backend == ["compress_cache_kernel"] and calls == [1]


def test_decode_verifier_reasons():
    q, k, v, _ = _paged([9], 130, 2, 16, 16, torch.float32)
    assert "at most 64 query heads per KV head" in decode_reason(q.to(DEVICE), k, v)
    assert "float16/bfloat16/float32" in decode_reason(q.double().to(DEVICE), k, v)


def test_explicit_triton_raises_with_the_reason(monkeypatch):
    monkeypatch.setenv("ATTNOPS_BACKEND", "triton")
    monkeypatch.setenv("ATTNOPS_TRITON_INTERPRET", "1")
    q, k, v, table = _paged([9], 2, 1, 264, 16, torch.float32)
    topk = torch.zeros(1, 1, 1, dtype=torch.int32)
    with pytest.raises(ParamInvalidError, match="head dims up to 256"):
        attnops.nsa_selected_attention_infer(*_dev(q, k, v, topk, table), [9], select_block_size=8)


def test_device_lengths_are_read_by_the_kernels_and_bad_values_clamped(triton_backend):
    """Lengths as a tensor (the kernels read them: what a GPU tensor does) give the list's result; unvalidated
    values (a length past the block table, a block id outside the cache, a negative index) read nothing out of
    bounds."""
    from attnops.ops.nsa import op

    lens = [37, 20, 9]
    q, k, v, table = _paged(lens, 4, 2, 16, 16, torch.float32, seed=40)
    topk = torch.tensor([[[2, 0], [1, -1]], [[0, 1], [-1, 0]], [[0, -1], [0, 0]]], dtype=torch.int32)
    args = (q, k, v, topk, table, 0.25, 4, 2, 16, 2, PAGE)
    want = op.nsa_selected_attention_infer(*args, lens)
    got = op.nsa_selected_attention_infer(*args, None, torch.tensor(lens))
    assert torch.equal(got, want)
    bad_table = table.clone()
    bad_table[0, 1] = 10_000
    bad_topk = topk.clone()
    bad_topk[1, 0, 0] = -7
    out = op.nsa_selected_attention_infer(q, k, v, bad_topk, bad_table, 0.25, 4, 2, 16, 2, PAGE, None,
                                          torch.tensor([10_000, -3, 9]))
    assert out.shape == want.shape and bool(out.isfinite().all())
    cmp_want = op.nsa_compress_attention_infer(q, k, v, table, 0.25, 4, 2, 64, 3, PAGE, 32, 16, [37, 20, 9])
    cmp_got = op.nsa_compress_attention_infer(q, k, v, table, 0.25, 4, 2, 64, 3, PAGE, 32, 16, None,
                                              torch.tensor([37, 20, 9]))
    assert torch.equal(cmp_got[0], cmp_want[0]) and torch.equal(cmp_got[1], cmp_want[1])
    compressed = ["compress_decode_kernel", "compress_decode_score_kernel", "topk_kernel"]
    assert triton_backend == ["selected_decode_kernel", "decode_merge_kernel"] * 3 + compressed * 2


def test_compress_into_cache_with_device_lengths_and_a_shared_row(triton_backend):
    """The device path with lengths as a tensor: a row named by two completing requests keeps the later one's
    block (as the reference), a request that completes nothing leaves its row alone."""
    from attnops.ops.nsa import op

    kv, w = randn(12, 16, 2, 24, seed=50), randn(32, 2, seed=51) / 32
    table = torch.tensor([[3, 7, 0, 9], [5, 1, 11, 2], [8, 4, 6, 10]], dtype=torch.int32)
    slots = torch.tensor([1, 1, 3])
    lens = [48, 40, 43]  # 48 and 40 complete a block (stride 8) into row 1; 43 does not
    cache = randn(5, 2, 24, seed=52)
    want = cache.clone()
    op.nsa_compress_infer(kv, w, slots, table, want, 32, 8, 16, lens)  # via the device path with host lengths
    reference = cache.clone()
    from attnops.ops.nsa.decode import compress_into_cache
    compress_into_cache(kv, w, slots, table, reference, lens, 32, 8)
    got = cache.clone()
    op.nsa_compress_infer(kv, w, slots, table, got, 32, 8, 16, None, torch.tensor(lens))
    torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-6)
    assert torch.equal(got, want) and torch.equal(got[3], cache[3]) and not torch.equal(got[1], cache[1])
