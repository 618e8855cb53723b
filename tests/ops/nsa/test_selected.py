"""nsa_selected_attention (+ backward) through the Pythonic API vs the fp64 golden."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.testing import golden_nsa as G

from .nsa_helpers import F64, check_selected, cum, randn, random_topk

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _inputs(q_lens, kv_lens, n1, n2, d, dv, dtype, *, seed=0, extra=0):
    q = randn(sum(q_lens) + extra, n1, d, dtype=dtype, seed=seed)
    k = randn(sum(kv_lens), n2, d, dtype=dtype, seed=seed + 1)
    v = randn(sum(kv_lens), n2, dv, dtype=dtype, seed=seed + 2)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_selected_varlen_matches_golden(dtype, causal):
    q_lens, kv_lens, bs, count = [7, 1, 12], [16, 24, 32], 8, 2
    q, k, v = _inputs(q_lens, kv_lens, 4, 2, 16, 8, dtype, seed=1)
    topk = random_topk(q_lens, kv_lens, 2, count, bs, seed=2)
    check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=causal)


@pytest.mark.parametrize("g", [1, 4, 16])
def test_selected_gqa(g):
    q_lens, kv_lens, bs, count = [6, 10], [16, 16], 4, 3
    n2 = 2 if g < 16 else 1
    q, k, v = _inputs(q_lens, kv_lens, n2 * g, n2, 8, 8, torch.float32, seed=3)
    topk = random_topk(q_lens, kv_lens, n2, count, bs, seed=4)
    check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=True)


@pytest.mark.parametrize("causal", [True, False])
def test_selected_duplicate_indices(causal):
    q_lens, kv_lens, bs, count = [9, 8], [16, 24], 4, 4
    q, k, v = _inputs(q_lens, kv_lens, 2, 1, 8, 8, torch.float16, seed=5)
    topk = random_topk(q_lens, kv_lens, 1, count, bs, seed=6, distinct=False)
    topk[:, :, 1] = topk[:, :, 0]  # every row has at least one duplicate
    topk[3, 0] = torch.tensor([2, 2, 2, 2])
    check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=causal)


def test_selected_fully_masked_rows():
    """Causal rows whose selected blocks all lie in the future: out 0, stats FLT_LOWEST/FLT_MAX, grads 0."""
    q_lens, kv_lens, bs = [6], [16], 4
    q, k, v = _inputs(q_lens, kv_lens, 2, 1, 8, 8, torch.float32, seed=7)
    topk = torch.tensor([[[1, 2]], [[3, 1]], [[0, 1]], [[2, 3]], [[1, 0]], [[1, 3]]], dtype=torch.int32)
    res = check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=True)
    for row in (0, 1, 3):  # rows 0..3 see block 0 only; block 1 starts at position 4
        assert bool((res["out"][row] == 0).all())
        assert bool((res["smax"][row] == G.FLT_LOWEST).all()) and bool((res["ssum"][row] == G.FLT_MAX).all())
        assert bool((res["grads"][0][row] == 0).all())
    assert bool((res["out"][5] != 0).any())


def test_selected_empty_batches_and_tail_tokens():
    """A batch with Sq = 0, and query tokens after the last batch (out 0, invalid statistics)."""
    q_lens, kv_lens, bs, count = [5, 0, 4], [16, 8, 16], 8, 2
    q, k, v = _inputs(q_lens, kv_lens, 2, 2, 8, 4, torch.float32, seed=8, extra=3)
    topk = random_topk(q_lens, kv_lens, 2, count, bs, seed=9, extra_tokens=3)
    res = check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=False)
    assert bool((res["out"][-3:] == 0).all()) and bool((res["smax"][-3:] == G.FLT_LOWEST).all())


def test_selected_cu_seqlens_spelling():
    q_lens, kv_lens, bs, count = [5, 3], [16, 8], 4, 2
    q, k, v = _inputs(q_lens, kv_lens, 2, 1, 8, 8, torch.float32, seed=10)
    topk = random_topk(q_lens, kv_lens, 1, count, bs, seed=11)
    a = attnops.nsa_selected_attention(q, k, v, topk, select_block_size=bs, actual_seq_qlen=cum(q_lens),
                                       actual_seq_kvlen=cum(kv_lens))
    b = attnops.nsa_selected_attention(q, k, v, topk, select_block_size=bs, cu_seqlens_q=[0] + cum(q_lens),
                                       cu_seqlens_k=torch.tensor([0] + cum(kv_lens)))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_selected_default_scale_and_return_value():
    q_lens, kv_lens, bs = [4], [8], 4
    q, k, v = _inputs(q_lens, kv_lens, 2, 1, 9, 8, F64, seed=12)
    topk = random_topk(q_lens, kv_lens, 1, 2, bs, seed=13)
    out = attnops.nsa_selected_attention(q, k, v, topk, select_block_size=bs, actual_seq_qlen=[4],
                                         actual_seq_kvlen=[8])
    assert isinstance(out, torch.Tensor)
    want = G.nsa_selected_attention(q, k, v, topk, 9 ** -0.5, bs, [4], [8], True)[0]
    torch.testing.assert_close(out, want)


def test_selected_dk_dv_differ_and_noncontiguous():
    q_lens, kv_lens, bs, count = [6, 6], [12, 12], 4, 2
    q = randn(12, 16, 2, dtype=torch.float32, seed=14).transpose(1, 2)  # [12, 2, 16] non-contiguous
    k = randn(24, 16, 1, dtype=torch.float32, seed=15).transpose(1, 2)
    v = randn(24, 1, 24, dtype=torch.float32, seed=16)[:, :, ::3]  # Dv = 8, strided
    topk = random_topk(q_lens, kv_lens, 1, count, bs, seed=17)
    check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=True)


def test_selected_int64_topk():
    q_lens, kv_lens, bs = [5], [16], 4
    q, k, v = _inputs(q_lens, kv_lens, 2, 1, 8, 8, torch.float32, seed=18)
    topk = random_topk(q_lens, kv_lens, 1, 2, bs, seed=19).long()
    check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=True, backward=False)


@pytest.mark.parametrize("bad", [-1, 4])
def test_selected_rejects_out_of_range_indices(bad):
    q, k, v = _inputs([3], [16], 2, 1, 8, 8, torch.float32, seed=20)
    topk = random_topk([3], [16], 1, 2, 4, seed=21)
    topk[1, 0, 1] = bad
    with pytest.raises(attnops.ParamInvalidError, match="topk_indices"):
        attnops.nsa_selected_attention(q, k, v, topk, select_block_size=4, actual_seq_qlen=[3],
                                       actual_seq_kvlen=[16])


@pytest.mark.parametrize("causal", [True, False])
def test_selected_unvalidated_out_of_range_indices_select_nothing(monkeypatch, causal):
    """``ATTNOPS_VALIDATE=0``: an index outside the batch's blocks (negative or too large) selects nothing."""
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
    q_lens, kv_lens, bs = [5, 6], [16, 24], 4
    q, k, v = _inputs(q_lens, kv_lens, 2, 1, 8, 8, torch.float32, seed=22)
    topk = random_topk(q_lens, kv_lens, 1, 3, bs, seed=23)
    topk[1, 0, 1], topk[7, 0, 0], topk[9, 0, 2] = -1, 6, -3  # batch 1 has 6 blocks: 6 is past them
    check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=causal)


def test_selected_fp32_kv_grad_accumulation():
    """4096 tokens all selecting blocks [0, 1] with a positive output gradient: each KV position sums 4096
    contributions; fp32 dk/dv must stay within 3x of plain fp32 PyTorch."""
    t, bs = 4096, 16
    q, k, v = randn(t, 1, 16, seed=1), randn(t, 1, 16, seed=2), randn(t, 1, 16, seed=3)
    dy = randn(t, 1, 16, seed=4).abs() + 1
    topk = torch.arange(2, dtype=torch.int32).expand(t, 1, 2).contiguous()
    check_selected(q, k, v, topk, block=bs, q_lens=[t], kv_lens=[t], causal=False, dy=dy)


@pytest.mark.parametrize("threads", [1, 2])
def test_selected_many_chunks_on_workers_match_golden_and_each_other(monkeypatch, threads):
    """Token chunks (forward) and chunk groups with dk/dv partials (backward) side by side: correct, and
    bit-identical to the single-threaded run."""
    from attnops.ops.nsa import selected

    q_lens, kv_lens, bs, count = [40, 23], [48, 32], 4, 3
    q, k, v = _inputs(q_lens, kv_lens, 4, 2, 8, 8, torch.float32, seed=12)
    topk = random_topk(q_lens, kv_lens, 2, count, bs, seed=13)
    monkeypatch.setattr(selected, "SCORE_BYTES", 4 * count * 2 * bs * 4)  # 4 tokens per chunk
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        res = check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=True)
        torch.set_num_threads(1)
        serial = check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=True)
    finally:
        torch.set_num_threads(before)
    for a, b in zip([res["out"], *res["grads"]], [serial["out"], *serial["grads"]]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [True, False])
def test_selected_local_window_runs(causal):
    """Every token selects its own block and the ones before it (block 0 repeated early, as NSA's local window
    does): each block is picked by runs of consecutive tokens, taken as slices; rows picking a block twice or out
    of order keep the gathered path in the same call, also where the repeats fill a gap to a run's length."""
    q_lens, kv_lens, bs, count = [70, 45], [80, 48], 8, 4
    q, k, v = _inputs(q_lens, kv_lens, 4, 2, 16, 8, torch.float32, seed=31)
    own = torch.cat([torch.arange(s) // bs for s in q_lens])
    topk = (own.view(-1, 1, 1) - torch.arange(count).view(1, 1, -1)).clamp(min=0)
    topk = topk.expand(-1, 2, -1).contiguous().to(torch.int32)
    topk[5, 1] = torch.tensor([3, 0, 3, 1])
    topk[45, 0] = torch.tensor([5, 4, 4, 2])  # block 4: tokens 32..45, 45, 47..63 (as many as a run of 32)
    topk[46, 0] = torch.tensor([5, 9, 3, 2])
    from attnops.ops.nsa import selected

    spec = selected.build_selected_spec(q, k, v, topk, scale_value=0.25, head_num=4, select_block_size=bs,
                                        select_block_count=count, actual_seq_qlen=cum(q_lens),
                                        actual_seq_kvlen=cum(kv_lens))
    segments = list(selected._Batch(spec, 0, 0, q, k, v, topk).segments(0, q_lens[0]))
    assert any(s.run for s in segments) and any(s.run is None for s in segments)
    check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=causal)


@pytest.mark.parametrize("forward", [False, True], ids=["given-stats", "forward-stats"])
def test_grad_has_the_same_bits_for_any_layout_of_its_inputs(forward):
    """Transposed-memory views of q, k, v and dy (the same values) give the very same gradients: the CPU backward's
    products read dense copies, so their sums run in one order whatever the strides."""
    from . import nsa_aclnn_params as P

    op = P.OPS["nsa_selected_attention_grad"][0]
    params = P.selected_grad_params(forward=forward)
    clean = op(*params.values())
    for name in ("query", "key", "value", "attention_out_grad"):
        x = params[name]
        perm = list(range(x.dim()))[::-1]
        strided = dict(params, **{name: x.permute(perm).contiguous().permute(perm)})
        assert not strided[name].is_contiguous()
        for a, b in zip(clean, op(*strided.values())):
            assert torch.equal(a, b), name
