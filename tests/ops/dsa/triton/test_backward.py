"""Sparse flash attention's Triton backward (dQ, then dK/dV of the shared latent over inverted index lists) through
the public operator's autograd, against fp64 autograd of the golden, in every layout pair: CUDA when there is a GPU,
else Triton's CPU interpreter (fp16/fp32, tiny shapes). Each test checks that the kernels ran (a silent fallback to
the reference fails)."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.testing.compare import assert_close_to_golden, sfa_reductions
from tests.ops.dsa.dsa_helpers import (golden_sfa_grads, pack_keys, pack_query, pack_rows, randn, random_rows,
                                       unpack_keys, unpack_rows)

from .conftest import DEVICE

pytest.importorskip("triton")

LAYOUTS = [("BSND", "BSND"), ("TND", "TND"), ("TND", "PA_BSND"), ("BSND", "PA_BSND")]
H, F = torch.float16, torch.float32
KERNELS = ["sparse_attention_kernel", "sparse_attention_dq_kernel", "sparse_attention_dkdv_kernel",
           "sparse_attention_dkdv_reduce_kernel"]
HEADS, D, DR = 5, 32, 16


def _inputs(q_lens, k_lens, dtype, count, block, mode, seed, *, rope=True, dv=None):
    qs = [randn(n, HEADS, D, dtype=dtype, seed=seed + b) for b, n in enumerate(q_lens)]
    ks = [randn(n, D, dtype=dtype, seed=seed + 20 + b) for b, n in enumerate(k_lens)]
    qr = [randn(n, HEADS, DR, dtype=dtype, seed=seed + 10 + b) for b, n in enumerate(q_lens)] if rope else None
    kr = [randn(n, DR, dtype=dtype, seed=seed + 30 + b) for b, n in enumerate(k_lens)] if rope else None
    vs = [randn(n, dv, dtype=dtype, seed=seed + 50 + b) for b, n in enumerate(k_lens)] if dv else None
    rows = random_rows(q_lens, k_lens, count, block=block, sparse_mode=mode, seed=seed + 40)
    return qs, qr, ks, kr, vs, rows


def _run_backward(layout_q, layout_kv, q_lens, k_lens, inputs, *, block, mode, scale=0.3):
    """Forward and backward on the device; ``(gradients, unpacked: valid rows of (dq, dq_rope, dk, dk_rope, dv),
    the output gradient per batch)``."""
    qs, qr, ks, kr, vs, rows = inputs
    q, q_len = pack_query(qs, layout_q)
    key_parts = [ks] + ([kr] if kr is not None else []) + ([vs] if vs is not None else [])
    packed, k_len, table = pack_keys(key_parts, layout_kv, block_size=16)
    k, rest = packed[0], packed[1:]
    k_rope = rest.pop(0) if kr is not None else None
    v = rest.pop(0) if vs is not None else None
    q_rope = pack_query(qr, layout_q)[0] if qr is not None else None
    idx = pack_rows(rows, layout_q, q.shape[1] if layout_q == "BSND" else None)
    leaves = [None if t is None else t.to(DEVICE).requires_grad_() for t in (q, q_rope, k, k_rope, v)]
    ql, qrl, kl, krl, vl = leaves
    out = attnops.sparse_flash_attention(ql, kl, kl if vl is None else vl, idx.to(DEVICE), scale=scale,
                                         query_rope=qrl, key_rope=krl, layout=layout_q, layout_kv=layout_kv,
                                         actual_seq_lengths_query=q_len, actual_seq_lengths_kv=k_len,
                                         block_table=None if table is None else table.to(DEVICE),
                                         sparse_block_size=block, sparse_mode=mode).attention_out
    grad = randn(*out.shape, seed=77).to(out.dtype)
    torch.autograd.backward(out, grad.to(DEVICE))
    grads = [None if t is None else t.grad.cpu() for t in leaves]
    lens = list(k_lens)
    got = (unpack_rows(grads[0], layout_q, q_lens), None if grads[1] is None else unpack_rows(grads[1], layout_q,
                                                                                                 q_lens),
           unpack_keys(grads[2], layout_kv, lens, table), None if grads[3] is None else unpack_keys(
               grads[3], layout_kv, lens, table), None if grads[4] is None else unpack_keys(grads[4], layout_kv, lens,
                                                                                            table))
    flat = unpack_rows(grad, layout_q, q_lens)
    per_batch = list(torch.split(flat, list(q_lens)))
    return grads, got, per_batch


def _check(got, golden, q_lens, count, dtype, *, block=1, rope=True):
    """Within the rule's bound around the golden, the baseline being the golden rounded to the gradients' dtype."""
    red = sfa_reductions(q_lens, HEADS, D, DR if rope else 0, count * block)
    for name, a, g in zip(("dq", "dq_rope", "dk", "dk_rope", "dv"), got, golden):
        base = None if g is None else g.to(dtype)
        assert_close_to_golden(name, a, g, base, factor=3.0, reduction=red.get(name, red["dk"]))
        if a is not None:
            assert a.dtype == dtype


CASES = [(q, k, 3, F, 1) for q, k in LAYOUTS] + [("BSND", "BSND", 0, F, 1), ("TND", "PA_BSND", 3, F, 4),
                                                 ("TND", "PA_BSND", 3, H, 1), ("BSND", "BSND", 3, H, 2)]
FAST = {("BSND", "BSND", 3, F, 1), ("TND", "PA_BSND", 3, F, 4), ("TND", "PA_BSND", 3, H, 1)}


@pytest.mark.parametrize("layout_q,layout_kv,mode,dtype,block", [
    pytest.param(*c, marks=() if c in FAST else pytest.mark.slow) for c in CASES])
def test_backward_kernels_match_fp64_autograd(triton_backend, layout_q, layout_kv, mode, dtype, block):
    """Lq > Lk in the first batch leaves rows without keys (zero dQ); keys nobody selects get 0."""
    q_lens, k_lens, count = [6, 1, 4], [3, 40, 20], 6
    inputs = _inputs(q_lens, k_lens, dtype, count, block, mode, seed=3)
    _, got, grads = _run_backward(layout_q, layout_kv, q_lens, k_lens, inputs, block=block, mode=mode)
    assert triton_backend == KERNELS
    qs, qr, ks, kr, vs, rows = inputs
    golden = golden_sfa_grads(qs, qr, ks, kr, vs, rows, grads, 0.3, sparse_mode=mode, block=block)
    _check(got, golden, q_lens, count, dtype, block=block)


def test_backward_separate_value_without_rope(triton_backend):
    """A value tensor of its own (its gradient from the value kernel path, Dv != D), no rope."""
    q_lens, k_lens, count = [4, 5], [7, 12], 5
    inputs = _inputs(q_lens, k_lens, F, count, 1, 3, seed=5, rope=False, dv=16)
    _, got, grads = _run_backward("TND", "TND", q_lens, k_lens, inputs, block=1, mode=3, scale=0.2)
    assert triton_backend == KERNELS
    qs, qr, ks, kr, vs, rows = inputs
    _check(got, golden_sfa_grads(qs, qr, ks, kr, vs, rows, grads, 0.2), q_lens, count, F, rope=False)


def test_split_lists_are_exact_and_deterministic(triton_backend):
    """A key selected by 5 rows: its list is cut into chunks (4 entries each in the interpreter) whose partials the
    reduction kernel adds; the gradients match the golden, and two passes give the same bits (one writer per
    element, a fixed summation order)."""
    q_lens, k_lens, count = [5, 3], [6, 9], 4
    inputs = _inputs(q_lens, k_lens, F, count, 1, 3, seed=8)
    assert max(sum(e == j for row in inputs[-1][0] for e in row) for j in range(6)) > 4
    first, got, grads = _run_backward("TND", "PA_BSND", q_lens, k_lens, inputs, block=1, mode=3)
    second, _, _ = _run_backward("TND", "PA_BSND", q_lens, k_lens, inputs, block=1, mode=3)
    for a, b in zip(first, second):
        assert a is None and b is None or torch.equal(a, b)
    qs, qr, ks, kr, vs, rows = inputs
    _check(got, golden_sfa_grads(qs, qr, ks, kr, vs, rows, grads, 0.3), q_lens, count, F)
