"""The Triton NSA kernels (selected attention forward/backward, compression forward/backward) through Triton's
interpreter (CPU tensors, ``ATTNOPS_BACKEND=triton``) against the fp64 golden with the tolerance rule. Every test
checks that the kernels ran (the reference never stands in)."""
from __future__ import annotations

import pytest
import torch

import attnops
import attnops.torch_npu as tnpu
from attnops.ops.nsa.triton import launch as nsa_launch
from attnops.testing import golden_nsa as G
from attnops.testing.compare import assert_close_to_golden

from ..nsa_helpers import (baseline_dtype, check_compress, check_selected, cum, nsa_reductions, randn,
                           random_topk)

pytest.importorskip("triton")


class _Recorder:
    """Stands in for the NSA kernel family: records each launched kernel, then runs it."""

    def __init__(self, family):
        self.family, self.kernels = family, []

    def run_all(self, launches, device):
        self.kernels += [launch.kernel for launch in launches]
        self.family.run_all(launches, device)


@pytest.fixture
def kernels(monkeypatch):
    """The kernels launched by the test (the Triton backend forced)."""
    monkeypatch.setenv("ATTNOPS_BACKEND", "triton")
    recorder = _Recorder(nsa_launch.KERNELS)
    monkeypatch.setattr(nsa_launch, "KERNELS", recorder)
    return recorder.kernels


SELECTED = ["selected_fwd_kernel", "selected_delta_kernel", "selected_dq_kernel", "selected_keys_kernel",
            "selected_dkdv_kernel", "selected_dkdv_reduce_kernel"]
COMPRESS = ["compress_fwd_kernel", "compress_dx_kernel", "compress_dw_kernel"]


def _qkv(q_lens, kv_lens, n1, n2, d, dv, dtype, *, seed=0, extra=0):
    return (randn(sum(q_lens) + extra, n1, d, dtype=dtype, seed=seed),
            randn(sum(kv_lens), n2, d, dtype=dtype, seed=seed + 1),
            randn(sum(kv_lens), n2, dv, dtype=dtype, seed=seed + 2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_selected_varlen(kernels, dtype, causal):
    """An empty batch, a one-token batch, tokens after the last batch."""
    q_lens, kv_lens, bs, count = [7, 0, 1, 12], [16, 8, 24, 32], 8, 2
    q, k, v = _qkv(q_lens, kv_lens, 4, 2, 16, 8, dtype, seed=1, extra=2)
    topk = random_topk(q_lens, kv_lens, 2, count, bs, seed=2, extra_tokens=2)
    res = check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=causal)
    assert bool((res["out"][-2:] == 0).all()) and bool((res["smax"][-2:] == G.FLT_LOWEST).all())
    assert kernels == SELECTED


@pytest.mark.parametrize("g", [1, 2, 4, 16])
def test_selected_gqa_groups(kernels, g):
    q_lens, kv_lens, bs, count = [5, 6], [16, 16], 4, 3
    n2 = 2 if g < 16 else 1
    q, k, v = _qkv(q_lens, kv_lens, n2 * g, n2, 8, 8, torch.float32, seed=3)
    topk = random_topk(q_lens, kv_lens, n2, count, bs, seed=4)
    check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=True)
    assert kernels == SELECTED


def test_selected_d192_dv128_long_blocks(kernels):
    """The paper's head dims, and select blocks of 32 keys walked in 16-key steps by the interpreter."""
    q_lens, kv_lens, bs, count = [3, 2], [64, 32], 32, 1
    q, k, v = _qkv(q_lens, kv_lens, 2, 1, 192, 128, torch.float16, seed=5)
    topk = random_topk(q_lens, kv_lens, 1, count, bs, seed=6)
    topk[0, 0, 0] = 1  # a block wholly in the future of row 0: a fully masked row
    res = check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=True)
    assert bool((res["out"][0] == 0).all()) and bool((res["grads"][0][0] == 0).all())
    assert kernels == SELECTED


@pytest.mark.parametrize("causal", [True, False])
def test_selected_duplicate_indices(kernels, causal):
    q_lens, kv_lens, bs, count = [9, 8], [16, 24], 4, 4
    q, k, v = _qkv(q_lens, kv_lens, 2, 1, 8, 8, torch.float16, seed=7)
    topk = random_topk(q_lens, kv_lens, 1, count, bs, seed=8, distinct=False)
    topk[:, :, 1] = topk[:, :, 0]
    topk[3, 0] = torch.tensor([2, 2, 2, 2])
    check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=causal)
    assert kernels == SELECTED


def test_selected_explicit_ops_grad_mode2(kernels):
    """torch_npu forward without a mask (not causal), then its grad in sparse_mode 2 without a mask (causal)."""
    block, count, q_lens, kv_lens, n1, n2, d = 8, 2, [10, 6], [24, 16], 4, 2, 16
    q, k, v = _qkv(q_lens, kv_lens, n1, n2, d, d, torch.float16, seed=9)
    topk = random_topk(q_lens, kv_lens, n2, count, block, seed=10)
    qc, kc, scale = cum(q_lens), cum(kv_lens), d ** -0.5
    dy = randn(16, n1, d, dtype=torch.float16, seed=11)
    out, smax, ssum = tnpu.npu_nsa_select_attention(q, k, v, topk, scale, n1, block, count, actual_seq_qlen=qc,
                                                    actual_seq_kvlen=kc)
    grads = tnpu.npu_nsa_select_attention_grad(dy, q, k, v, out, smax, ssum, topk, scale, n1, block, count,
                                               actual_seq_qlen=qc, actual_seq_kvlen=kc)
    for dt, role in ((torch.float64, "golden"), (baseline_dtype(q.dtype), "baseline")):
        o, m, s = G.nsa_selected_attention(q, k, v, topk, scale, block, qc, kc, False, dtype=dt)
        ref = G.nsa_selected_attention_grad_from_stats(dy, q, k, v, o, m, s, topk, scale, block, qc, kc, True,
                                                       dtype=dt)
        if role == "golden":
            golden = ref
    for name, a, gg, bb in zip(("dq", "dk", "dv"), grads, golden, ref):
        assert_close_to_golden(f"selected_grad.{name}", a, gg, bb, factor=3,
                               reduction=nsa_reductions(q, k, v, q_lens, count * block, topk)[name])
    assert kernels == SELECTED


def test_selected_backward_is_deterministic(kernels):
    """Many tokens select the same blocks (duplicates too): two backward runs are bit-identical."""
    q_lens, kv_lens, bs, count = [20], [16], 4, 3
    q, k, v = _qkv(q_lens, kv_lens, 2, 1, 16, 16, torch.float32, seed=12)
    topk = random_topk(q_lens, kv_lens, 1, count, bs, seed=13, distinct=False)
    dy = randn(20, 2, 16, seed=14)
    runs = []
    for _ in range(2):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        attnops.nsa_selected_attention(qq, kk, vv, topk, select_block_size=bs, causal=True,
                                       actual_seq_qlen=q_lens, actual_seq_kvlen=kv_lens).backward(dy)
        runs.append((qq.grad, kk.grad, vv.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert kernels == SELECTED * 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_selected_long_lists_split_over_programs(kernels, dtype):
    """Block 0 forced for every token (the NSA layer's rule): its lists are far longer than a chunk (4 entries in the
    interpreter), so several dK/dV programs share each and their partials are added in chunk order; the gradients
    match the golden and two backward runs are bit-identical."""
    q_lens, kv_lens, bs, count = [12, 9], [32, 24], 8, 2
    q, k, v = _qkv(q_lens, kv_lens, 4, 2, 16, 16, dtype, seed=40)
    topk = random_topk(q_lens, kv_lens, 2, count, bs, seed=41)
    topk[:, :, 0] = 0
    runs = [check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=True)["grads"]
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert kernels == SELECTED * 2


def test_list_chunk_bounds_the_partials():
    """On a GPU a chunk is 4 mean lists (so the split lists' partials, at most ``2 * pairs // chunk`` chunks, take at
    most half of fp32 dK/dV: a quarter of the lists), at least 1024 rows, and its rows fit an int32."""
    from attnops.ops.common.inverted_lists import list_chunk

    pairs, lists = 65536 * 4 * 16, 4 * 1024  # T=64k, 4 KV heads, 16 slots, 1024 blocks
    chunk = list_chunk(pairs, lists, 16, interpret=False)
    assert chunk == 4096 and 2 * (pairs // chunk) <= lists // 2
    assert list_chunk(64, 64, 16, interpret=False) * 16 >= 1024
    assert list_chunk(1 << 40, 1, 64, interpret=False) * 64 <= 1 << 30
    assert list_chunk(pairs, lists, 16, interpret=True) == 4
    assert list_chunk(0, 4, 4096, interpret=False) == 2  # the schedule's chunk count needs 2 or more


@pytest.mark.parametrize("pairs_per_token", [1, 4])
def test_inverted_list_schedule(pairs_per_token):
    """The dK/dV units of lists of 0, 3, 9 and 4 entries in chunks of 4: one unit per list at least, the long list's
    three chunks in partial slots 0-2; each entry's token is its pair position over ``pairs_per_token``."""
    from attnops.ops.common.inverted_lists import InvertedLists

    lengths = [0, 3, 9, 4]
    keys = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))[torch.randperm(16)]
    lists = InvertedLists.allocate(keys, 4, 4, 1, (1,), pairs_per_token)
    lists.schedule()
    assert lists.list_start.tolist() == [0, 0, 3, 12, 16]
    assert lists.unit_end.tolist() == [1, 2, 5, 6]
    assert lists.unit_list.tolist() == [0, 1, 2, 2, 2, 3, 4, 4]
    assert lists.slot_end.tolist() == [0, 0, 3, 3]
    assert torch.equal(lists.sorted_keys, keys.sort(stable=True).values)
    assert torch.equal(lists.token, (torch.arange(16) // pairs_per_token).to(torch.int32)[lists.pair])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_compress_varlen(kernels, dtype):
    """Overlapping blocks (stride < block), a sequence shorter than a block, an empty one, tail tokens."""
    x, w = randn(40, 2, 16, dtype=dtype, seed=15), randn(4, 2, dtype=dtype, seed=16)
    check_compress(x, w, 4, 2, [11, 13, 13, 30])
    assert kernels == COMPRESS


def test_compress_d192_and_explicit_grad_op(kernels):
    x, w = randn(80, 2, 192, dtype=torch.float16, seed=17), randn(32, 2, dtype=torch.float16, seed=18)
    check_compress(x, w, 32, 16, [0, 50, 80], via="aclnn")
    assert kernels == COMPRESS


def test_compress_weight_grad_is_deterministic(kernels):
    x, w = randn(70, 1, 16, seed=19), randn(4, 1, seed=20)
    dy = randn(34, 1, 16, seed=21)  # 34 rows: three weight-gradient programs in the interpreter
    grads = []
    for _ in range(2):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        attnops.nsa_compress(xx, ww, block_size=4, stride=2).backward(dy)
        grads.append((xx.grad, ww.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert kernels == COMPRESS * 2


# ----------------------------------------------------------------------------------------------- dispatch
def _selected_call(dtype=torch.float32, d=8, g=1):
    q, k, v = _qkv([4], [8], g, 1, d, d, dtype)
    topk = random_topk([4], [8], 1, 1, 4)
    return lambda: attnops.nsa_selected_attention(q, k, v, topk, select_block_size=4, actual_seq_qlen=[4],
                                                  actual_seq_kvlen=[8])


@pytest.mark.parametrize("call,reason", [
    (_selected_call(torch.bfloat16), "no bfloat16"),
    (_selected_call(torch.float64), "float16/bfloat16/float32"),
    (_selected_call(d=264), "head dims up to 256 (got D=264, Dv=264)"),
    (_selected_call(g=65), "query heads per KV head up to 64 (got 65)"),
    (lambda: attnops.nsa_compress(randn(8, 1, 300), randn(4, 1), block_size=4, stride=4),
     "head dims up to 256 (got D=300)"),
], ids=["bf16-interpreter", "fp64", "head-dim", "group", "compress-head-dim"])
def test_forced_triton_raises_the_verifier_reason(kernels, call, reason):
    with pytest.raises(Exception, match=reason.replace("(", r"\(").replace(")", r"\)")):
        call()
    assert kernels == []


def test_auto_keeps_the_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("ATTNOPS_BACKEND", raising=False)
    recorder = _Recorder(nsa_launch.KERNELS)
    monkeypatch.setattr(nsa_launch, "KERNELS", recorder)
    _selected_call()()
    attnops.nsa_compress(randn(8, 1, 8), randn(4, 1), block_size=4, stride=4)
    assert recorder.kernels == []


# ------------------------------------------------------------------------------------ unvalidated device indices
def test_indices_outside_the_batch_select_nothing(kernels):
    """On a GPU nobody validates the indices: the kernels skip a slot outside the batch's blocks (never read out of
    bounds), as the CPU reference does for such unvalidated indices; both equal the call without those slots."""
    from attnops.ops.nsa import selected as reference
    from attnops.ops.nsa.selected import build_selected_spec

    q_lens, kv_lens, bs = [5, 6], [24, 32], 8
    q, k, v = _qkv(q_lens, kv_lens, 2, 1, 16, 8, torch.float32, seed=30)
    valid = random_topk(q_lens, kv_lens, 1, 3, bs, seed=31, distinct=False)
    bad = valid.clone()
    bad[0, 0, 1], bad[3, 0, 0], bad[7, 0, 2], bad[10, 0, :] = -1, 3, 4, -5  # batch 0 has blocks 0-2, batch 1 0-3
    dy = randn(11, 2, 8, seed=32)
    spec = build_selected_spec(q, k, v, valid, scale_value=0.25, head_num=2, select_block_size=bs,
                               select_block_count=3, actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(kv_lens),
                               grad=True)
    results = {}
    for name, impl in (("kernels", nsa_launch), ("reference", reference)):
        out, smax, ssum = impl.selected_forward(spec, q, k, v, bad)
        results[name] = (out, *impl.selected_backward(spec, q, k, v, out, dy, smax, ssum, bad))
    for a, b in zip(*results.values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert bool((results["kernels"][0][10] == 0).all())  # a token whose slots are all outside: output 0
    assert kernels == SELECTED
