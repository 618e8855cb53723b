"""Sparse flash attention (Pythonic API) vs the fp64 golden: layouts, causal modes, sparse blocks, rope, sinks,
statistics and gradients."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.testing.compare import assert_close_to_golden, sfa_reductions

from .dsa_helpers import golden_sfa, pack_keys, pack_query, pack_rows, randn, random_rows, unpack_rows

LAYOUTS = [("BSND", "BSND"), ("TND", "TND"), ("TND", "PA_BSND"), ("BSND", "PA_BSND")]


def _case(q_lens, k_lens, heads, d, dr, dtype, *, count, block=1, mode=3, seed=0):
    qs = [randn(n, heads, d, dtype=dtype, seed=seed + b) for b, n in enumerate(q_lens)]
    qr = [randn(n, heads, dr, dtype=dtype, seed=seed + 10 + b) for b, n in enumerate(q_lens)]
    ks = [randn(n, d, dtype=dtype, seed=seed + 20 + b) for b, n in enumerate(k_lens)]
    kr = [randn(n, dr, dtype=dtype, seed=seed + 30 + b) for b, n in enumerate(k_lens)]
    rows = random_rows(q_lens, k_lens, count, block=block, sparse_mode=mode, seed=seed + 40)
    return qs, qr, ks, kr, rows


def _run(layout_q, layout_kv, qs, qr, ks, kr, rows, *, block=1, mode=3, sinks=None, scale=0.3, rope=True):
    q, q_lens = pack_query(qs, layout_q)
    q_rope, _ = pack_query(qr, layout_q)
    (k, k_rope), k_lens, table = pack_keys([ks, kr], layout_kv, block_size=16)
    idx = pack_rows(rows, layout_q, q.shape[1] if layout_q == "BSND" else None)
    res = attnops.sparse_flash_attention(
        q, k, k, idx, scale=scale, query_rope=q_rope if rope else None, key_rope=k_rope if rope else None,
        layout=layout_q, layout_kv=layout_kv, actual_seq_lengths_query=q_lens, actual_seq_lengths_kv=k_lens,
        block_table=table, sparse_block_size=block, sparse_mode=mode, sinks=sinks)
    return res, (q, q_rope, k, k_rope, idx, q_lens, k_lens, table)


@pytest.mark.parametrize("layout_q,layout_kv", LAYOUTS)
@pytest.mark.parametrize("mode", [0, 3])
def test_forward_matches_golden(layout_q, layout_kv, mode):
    q_lens, k_lens = [5, 1, 7], ([9, 33, 7] if mode == 3 else [9, 33, 2])
    case = _case(q_lens, k_lens, 4, 16, 8, torch.float32, count=6, mode=mode, seed=1)
    res, _ = _run(layout_q, layout_kv, *case, mode=mode)
    qs, qr, ks, kr, rows = case
    g = golden_sfa(qs, ks, ks, rows, 0.3, q_rope=qr, k_rope=kr, sparse_mode=mode)
    b = golden_sfa(qs, ks, ks, rows, 0.3, q_rope=qr, k_rope=kr, sparse_mode=mode, dtype=torch.float32)
    red = sfa_reductions(q_lens, 4, 16, 8, 6)
    assert_close_to_golden("out", unpack_rows(res.attention_out, layout_q, q_lens), g[0], b[0], reduction=red["out"])
    stats = res.softmax_max.reshape(-1, 4) if layout_q == "TND" else res.softmax_max[:, 0]
    assert_close_to_golden("max", unpack_rows(stats, layout_q, q_lens), g[1], b[1], reduction=red["max"])


@pytest.mark.parametrize("block", [2, 8])
def test_sparse_blocks(block):
    q_lens, k_lens = [6, 3], [40, 17]
    case = _case(q_lens, k_lens, 2, 8, 4, torch.float32, count=3, block=block, seed=2)
    res, _ = _run("TND", "PA_BSND", *case, block=block)
    g = golden_sfa(case[0], case[2], case[2], case[4], 0.3, q_rope=case[1], k_rope=case[3], block=block)
    b = golden_sfa(case[0], case[2], case[2], case[4], 0.3, q_rope=case[1], k_rope=case[3], block=block,
                   dtype=torch.float32)
    assert_close_to_golden("out", unpack_rows(res.attention_out, "TND", q_lens), g[0], b[0],
                           reduction=sfa_reductions(q_lens, 2, 8, 4, 3 * block)["out"])


def test_sinks_and_empty_rows():
    """Lq > Lk leaves the first rows without keys: zeros (statistics (0, 0); with sinks (sink, 1))."""
    q_lens, k_lens = [6], [3]
    case = _case(q_lens, k_lens, 4, 8, 4, torch.float32, count=4, seed=3)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    for s in (None, sinks):
        res, _ = _run("BSND", "BSND", *case, sinks=s)
        g = golden_sfa(case[0], case[2], case[2], case[4], 0.3, q_rope=case[1], k_rope=case[3], sinks=s)
        b = golden_sfa(case[0], case[2], case[2], case[4], 0.3, q_rope=case[1], k_rope=case[3], sinks=s,
                       dtype=torch.float32)
        red = sfa_reductions(q_lens, 4, 8, 4, 4, sinks=s is not None)
        assert_close_to_golden("out", res.attention_out[0], g[0], b[0], reduction=red["out"])
        assert_close_to_golden("sum", res.softmax_sum[0, 0], g[2], b[2], reduction=red["sum"])
    assert res.attention_out[0, :3].abs().max() == 0


def test_bf16_within_tolerance():
    q_lens, k_lens = [4, 9], [20, 9]
    case = _case(q_lens, k_lens, 4, 32, 8, torch.bfloat16, count=8, seed=4)
    res, _ = _run("TND", "PA_BSND", *case)
    qs, qr, ks, kr, rows = case
    g = golden_sfa(qs, ks, ks, rows, 0.3, q_rope=qr, k_rope=kr)
    b = golden_sfa(qs, ks, ks, rows, 0.3, q_rope=qr, k_rope=kr, dtype=torch.bfloat16)
    assert res.attention_out.dtype == torch.bfloat16
    assert_close_to_golden("out", unpack_rows(res.attention_out, "TND", q_lens), g[0], b[0],
                           reduction=sfa_reductions(q_lens, 4, 32, 8, 8)["out"])


@pytest.mark.parametrize("layout_q,layout_kv", [("BSND", "BSND"), ("TND", "PA_BSND")])
def test_gradients_match_fp64_autograd(layout_q, layout_kv):
    q_lens, k_lens = [5, 3], [9, 12]
    case = _case(q_lens, k_lens, 3, 8, 4, torch.float32, count=5, seed=5)
    res, (q, q_rope, k, k_rope, idx, ql, kl, table) = _run(layout_q, layout_kv, *case)
    leaves = [t.detach().requires_grad_() for t in (q, q_rope, k, k_rope)]
    out = attnops.sparse_flash_attention(
        leaves[0], leaves[2], leaves[2], idx, scale=0.3, query_rope=leaves[1], key_rope=leaves[3], layout=layout_q,
        layout_kv=layout_kv, actual_seq_lengths_query=ql, actual_seq_lengths_kv=kl, block_table=table).attention_out
    grad = randn(*out.shape, seed=6)
    torch.autograd.backward(out, grad)

    ref = [t.detach().double().requires_grad_() for t in (q, q_rope, k, k_rope)]
    torch.autograd.backward(_dense_golden(ref, idx, layout_q, layout_kv, ql, kl, table), grad.double())
    golden = [t.grad for t in ref]
    red = sfa_reductions(q_lens, 3, 8, 4, 5)
    for name, leaf, g in zip(("dq", "dq_rope", "dk", "dk_rope"), leaves, golden):
        assert_close_to_golden(name, leaf.grad, g, None, factor=3.0, reduction=red[name])


def _dense_golden(ref, idx, layout_q, layout_kv, q_lens, k_lens, table):
    """The golden's output on the packed tensors (autograd flows through the gathers)."""
    from attnops.testing import golden_dsa as G

    q, q_rope, k, k_rope = ref
    out = torch.zeros(*q.shape, dtype=torch.float64)
    starts_q = [0] + (q_lens.cumsum(0)[:-1].tolist() if layout_q == "TND" else [])
    q_ends = q_lens.tolist()
    for b in range(len(q_ends)):
        lq = q_ends[b] - (starts_q[b] if layout_q == "TND" else 0)
        qs = q[starts_q[b]:starts_q[b] + lq] if layout_q == "TND" else q[b, :lq]
        qr = q_rope[starts_q[b]:starts_q[b] + lq] if layout_q == "TND" else q_rope[b, :lq]
        rows = (idx[starts_q[b]:starts_q[b] + lq] if layout_q == "TND" else idx[b, :lq])[:, 0].tolist()
        lk = int(k_lens[b])
        if layout_kv == "PA_BSND":
            pos = torch.arange(lk)
            kk = k[table[b, pos // k.shape[1]].long(), pos % k.shape[1], 0]
            kkr = k_rope[table[b, pos // k.shape[1]].long(), pos % k.shape[1], 0]
        else:
            kk, kkr = k[b, :lk, 0], k_rope[b, :lk, 0]
        o = G.sparse_flash_attention(qs, kk, kk, rows, 0.3, q_rope=qr, k_rope=kkr)[0]
        if layout_q == "TND":
            out = out.index_put((torch.arange(starts_q[b], starts_q[b] + lq),), o)
        else:
            out = out.index_put((torch.tensor([b]), torch.arange(lq)), o)
    return out


def test_gradcheck_fp64():
    case = _case([3], [5], 2, 4, 2, torch.float64, count=3, seed=7)
    _, (q, q_rope, k, k_rope, idx, ql, kl, _) = _run("BSND", "BSND", *case)

    def f(q, qr, k, kr):
        return attnops.sparse_flash_attention(q, k, k, idx, scale=0.7, query_rope=qr, key_rope=kr).attention_out

    assert torch.autograd.gradcheck(f, [t.detach().requires_grad_() for t in (q, q_rope, k, k_rope)])
