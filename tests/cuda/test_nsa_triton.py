"""The compiled Triton NSA kernels on CUDA (selected attention and compression, forward and backward) vs the fp64
golden in fp16, bf16 and fp32 at the paper's head dims (D=192, Dv=128, a GQA group of 16) and shapes that use the
GPU tiles; two backward runs bit-identical. The goldens run on CPU copies."""
import pytest
import torch

import attnops
from attnops.testing import golden_nsa as G
from attnops.testing.compare import assert_close_to_golden
from tests.ops.nsa.nsa_helpers import baseline_dtype, cum, nsa_reductions, randn, random_topk

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _grads(fn, inputs, dy):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(dy)
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", (True, False))
def test_selected_matches_golden(monkeypatch, dtype, causal):
    monkeypatch.setenv("ATTNOPS_BACKEND", "triton")
    q_lens, kv_lens, n2, g, d, dv, bs, count = [100, 0, 60], [256, 64, 192], 2, 16, 192, 128, 32, 4
    q = randn(sum(q_lens), n2 * g, d, dtype=dtype, seed=1)
    k, v = randn(sum(kv_lens), n2, d, dtype=dtype, seed=2), randn(sum(kv_lens), n2, dv, dtype=dtype, seed=3)
    topk = random_topk(q_lens, kv_lens, n2, count, bs, seed=4, distinct=False)  # duplicates included
    dy = randn(sum(q_lens), n2 * g, dv, dtype=dtype, seed=5)
    qc, kc, scale = cum(q_lens), cum(kv_lens), d ** -0.5

    def run(q, k, v):
        return attnops.nsa_selected_attention(q, k, v, topk.cuda(), select_block_size=bs, causal=causal,
                                              scale=scale, actual_seq_qlen=qc, actual_seq_kvlen=kc)

    out, grads = _grads(run, [t.cuda() for t in (q, k, v)], dy.cuda())
    _, again = _grads(run, [t.cuda() for t in (q, k, v)], dy.cuda())
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    golden = G.nsa_selected_attention(q, k, v, topk, scale, bs, qc, kc, causal)[0]
    base = G.nsa_selected_attention(q, k, v, topk, scale, bs, qc, kc, causal, dtype=baseline_dtype(dtype))[0]
    red = nsa_reductions(q, k, v, q_lens, count * bs, topk)
    assert_close_to_golden("selected.out", out.cpu(), golden, base, factor=2, reduction=red["out"])
    given = out.detach().cpu()  # the backward forms D = rowsum(dy * out) from the output it computed
    g_grads = G.nsa_selected_attention_backward(dy, q, k, v, topk, scale, bs, qc, kc, causal, attention_in=given)
    b_grads = G.nsa_selected_attention_backward(dy, q, k, v, topk, scale, bs, qc, kc, causal,
                                                dtype=baseline_dtype(dtype), attention_in=given)
    for name, a, gg, bb in zip(("dq", "dk", "dv"), grads, g_grads, b_grads):
        assert_close_to_golden(f"selected.{name}", a.cpu(), gg, bb, factor=3, reduction=red[name])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_selected_long_list_split_over_programs(monkeypatch, dtype):
    """Block 0 selected by every token (the NSA layer's rule): its list (512 entries) is longer than a dK/dV chunk
    (4 mean lists: 256), so two programs share it and a second kernel adds their partials in order; the gradients
    match the golden and two backward runs are bit-identical."""
    from attnops.ops.common.inverted_lists import list_chunk

    monkeypatch.setenv("ATTNOPS_BACKEND", "triton")
    t, g, d, dv, bs, count = 512, 16, 192, 128, 32, 4
    assert t > list_chunk(t * count, t * 2 // bs, g, interpret=False)  # 1024 keys: 32 blocks
    q, k, v = randn(t, g, d, dtype=dtype, seed=11), randn(2 * t, 1, d, dtype=dtype, seed=12), randn(
        2 * t, 1, dv, dtype=dtype, seed=13)
    topk = random_topk([t], [2 * t], 1, count, bs, seed=14)
    topk[:, :, 0] = 0
    dy = randn(t, g, dv, dtype=dtype, seed=15)
    qc, kc, scale = cum([t]), cum([2 * t]), d ** -0.5

    def run(q, k, v):
        return attnops.nsa_selected_attention(q, k, v, topk.cuda(), select_block_size=bs, causal=True, scale=scale,
                                              actual_seq_qlen=qc, actual_seq_kvlen=kc)

    out, grads = _grads(run, [x.cuda() for x in (q, k, v)], dy.cuda())
    _, again = _grads(run, [x.cuda() for x in (q, k, v)], dy.cuda())
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    given = out.detach().cpu()
    g_grads = G.nsa_selected_attention_backward(dy, q, k, v, topk, scale, bs, qc, kc, True, attention_in=given)
    b_grads = G.nsa_selected_attention_backward(dy, q, k, v, topk, scale, bs, qc, kc, True,
                                                dtype=baseline_dtype(dtype), attention_in=given)
    red = nsa_reductions(q, k, v, [t], count * bs, topk)
    for name, a, gg, bb in zip(("dq", "dk", "dv"), grads, g_grads, b_grads):
        assert_close_to_golden(f"selected_split.{name}", a.cpu(), gg, bb, factor=3, reduction=red[name])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compress_matches_golden(monkeypatch, dtype):
    monkeypatch.setenv("ATTNOPS_BACKEND", "triton")
    x, w = randn(700, 4, 192, dtype=dtype, seed=6), randn(32, 4, dtype=dtype, seed=7)
    seq = [0, 300, 310, 700]
    golden = G.nsa_compress(x, w, 32, 16, seq)
    dy = randn(*golden.shape, dtype=dtype, seed=8)

    def run(x, w):
        return attnops.nsa_compress(x, w, block_size=32, stride=16, actual_seq_len=seq)

    out, grads = _grads(run, [x.cuda(), w.cuda()], dy.cuda())
    _, again = _grads(run, [x.cuda(), w.cuda()], dy.cuda())
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    base = G.nsa_compress(x, w, 32, 16, seq, dtype=baseline_dtype(dtype))
    assert_close_to_golden("compress.out", out.cpu(), golden, base, factor=2, reduction=32)  # one block
    g_grads = G.nsa_compress_backward(dy, x, w, 32, 16, seq)
    b_grads = G.nsa_compress_backward(dy, x, w, 32, 16, seq, dtype=baseline_dtype(dtype))
    # a token is in two compressed rows; a weight's gradient sums over every compressed row and the head dim
    red = dict(input_grad=2, weight_grad=golden.shape[0] * x.shape[-1])
    for name, a, gg, bb in zip(("input_grad", "weight_grad"), grads, g_grads, b_grads):
        assert_close_to_golden(f"compress.{name}", a.cpu(), gg, bb, factor=3, reduction=red[name])
