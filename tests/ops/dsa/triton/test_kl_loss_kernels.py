"""The indexer KL loss's Triton kernels (the fused loss and indexer gradients, ``d_key_index`` from inverted index
lists) against the fp64 golden, BSND and multi-batch TND: CUDA when there is a GPU, else Triton's CPU interpreter
(fp16/fp32, tiny shapes). Each test checks that the kernels ran (a silent fallback to the reference fails)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from attnops.ops.dsa import op as dsa_op
from attnops.ops.dsa.validate import kl_loss_call
from attnops.testing import golden_dsa as G
from attnops.testing.compare import assert_close_to_golden, kl_reductions
from tests.ops.dsa.dsa_helpers import pack_query, pack_rows, randn, random_rows

from .conftest import DEVICE

pytest.importorskip("triton")

from attnops.ops.dsa.triton import kl_launch  # noqa: E402

H, F = torch.float16, torch.float32
HEADS, D, DR, NI, DI, SCALE = 5, 32, 16, 3, 16, 0.2
KERNELS = ["indexer_kl_loss_kernel", "indexer_kl_loss_sum_kernel", "indexer_kl_loss_dk_kernel",
           "sparse_attention_dkdv_reduce_kernel"]
NAMES = ("d_query_index", "d_key_index", "d_weights")


def _inputs(q_lens, k_lens, dtype, count, rows=None, seed=0):
    """Per-batch tensors (weights fp32, of both signs), index rows and the golden's attention statistics."""
    qs = [randn(n, HEADS, D, dtype=dtype, seed=seed + b) for b, n in enumerate(q_lens)]
    qr = [randn(n, HEADS, DR, dtype=dtype, seed=seed + 10 + b) for b, n in enumerate(q_lens)]
    ks = [randn(n, D, dtype=dtype, seed=seed + 20 + b) for b, n in enumerate(k_lens)]
    kr = [randn(n, DR, dtype=dtype, seed=seed + 30 + b) for b, n in enumerate(k_lens)]
    qis = [randn(n, NI, DI, dtype=dtype, seed=seed + 40 + b) for b, n in enumerate(q_lens)]
    kis = [randn(n, DI, dtype=dtype, seed=seed + 50 + b) for b, n in enumerate(k_lens)]
    ws = [randn(n, NI, seed=seed + 60 + b) for b, n in enumerate(q_lens)]
    rows = rows or random_rows(q_lens, k_lens, count, seed=seed + 70)
    stats = [G.sparse_flash_attention(q, k, k, r, SCALE, q_rope=a, k_rope=c)[1:]
             for q, k, r, a, c in zip(qs, ks, rows, qr, kr)]
    return dict(q=qs, qr=qr, k=ks, kr=kr, qi=qis, ki=kis, w=ws, rows=rows, m=[s[0] for s in stats],
                l=[s[1] for s in stats])


def _golden(x, dtype=torch.float64):
    """``(loss, d_qi [R, Ni, Di], d_ki [R2, Di], d_w [R, Ni])`` over every batch (valid rows, batch after batch)."""
    parts = [G.indexer_kl_loss_grad(*args, SCALE, q_rope=a, k_rope=c, dtype=dtype)
             for *args, a, c in zip(x["q"], x["k"], x["qi"], x["ki"], x["w"], x["rows"], x["m"], x["l"], x["qr"],
                                    x["kr"])]
    return (sum(p[0] for p in parts), *(torch.cat([p[i] for p in parts]) for i in (1, 2, 3)))


def _packed(x, layout):
    """The operator's arguments on the device: tensors in ``layout`` and the TND lengths as cumulative lists."""
    q_lens, k_lens = [q.shape[0] for q in x["q"]], [k.shape[0] for k in x["k"]]
    query = {name: pack_query(x[name], layout)[0] for name in ("q", "qr", "qi", "w")}
    keys = {name: pack_query([t[:, None] for t in x[name]], layout)[0] for name in ("k", "kr", "ki")}
    stats = [pack_query([t.float() for t in x[name]], layout)[0] for name in ("m", "l")]
    stats = [s[None] if layout == "TND" else s[:, None] for s in stats]
    idx = pack_rows(x["rows"], layout)
    lens = dict(actual_seq_qlen=None, actual_seq_klen=None)
    if layout == "TND":  # host values: cumulative ends
        lens = dict(actual_seq_qlen=torch.tensor(q_lens).cumsum(0), actual_seq_klen=torch.tensor(k_lens).cumsum(0))
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    return ((dev(query["q"]), dev(keys["k"]), dev(query["qi"]), dev(keys["ki"]), dev(query["w"]), dev(idx),
             *map(dev, stats)), dict(query_rope=dev(query["qr"]), key_rope=dev(keys["kr"]), layout=layout, **lens))


def _unpacked(got, layout, q_lens, k_lens):
    """``(d_qi, d_ki, d_w)`` restricted to the valid rows, batch after batch."""
    def rows(t, lens):
        t = t.cpu()
        return t[:sum(lens)] if layout == "TND" else torch.cat([t[b, :n] for b, n in enumerate(lens)])

    return rows(got[0], q_lens), rows(got[1], k_lens)[:, 0], rows(got[2], q_lens)


def _run(x, layout):
    """The operator (its custom op: any head dims) on the device."""
    args, kw = _packed(x, layout)
    return dsa_op.dsa_indexer_kl_loss_grad(*args, kw["query_rope"], kw["key_rope"], SCALE, kw["actual_seq_qlen"],
                                           kw["actual_seq_klen"], layout, 3)


def _check(got, x, layout, dtype, count):
    """Within the rule's bound around the golden: the loss (fp32) against a plain fp32 golden, the gradients too for
    fp32 inputs; fp16 gradients against the golden rounded to fp16."""
    q_lens, k_lens = [q.shape[0] for q in x["q"]], [k.shape[0] for k in x["k"]]
    golden, fp32 = _golden(x), _golden(x, torch.float32)
    base = fp32 if dtype == F else tuple(g.to(dtype) for g in golden)
    red = kl_reductions(max(q_lens), HEADS, D, DR, NI, DI, count)
    assert got[3].shape == (1,) and got[3].dtype == torch.float32
    assert_close_to_golden("loss", got[3].cpu()[0], golden[0], fp32[0], reduction=red["loss"])
    for name, a, g, b in zip(NAMES, _unpacked(got, layout, q_lens, k_lens), golden[1:], base[1:]):
        assert a.dtype == (F if name == "d_weights" else dtype)
        assert_close_to_golden(name, a, g, b, factor=3.0, reduction=red[name])


CASES = [("BSND", F), ("TND", F), ("TND", H), ("BSND", H)]


@pytest.mark.parametrize("layout,dtype", [pytest.param(*c, marks=() if c[0] == "TND" else pytest.mark.slow)
                                          for c in CASES])
def test_kl_loss_kernels_match_the_golden(triton_backend, layout, dtype):
    """TND: batches of 3, 0, 6 and 1 rows (Lq > Lk in the last: a row without keys); BSND: two batches of 6."""
    q_lens, k_lens = ([3, 0, 6, 1], [5, 2, 6, 0]) if layout == "TND" else ([6, 6], [6, 6])
    x = _inputs(q_lens, k_lens, dtype, 4)
    got = _run(x, layout)
    assert triton_backend == KERNELS
    _check(got, x, layout, dtype, 4)


def test_split_lists_are_exact_and_deterministic(triton_backend, monkeypatch):
    """Key 0 selected by all 7 rows (its list cut into chunks of 4 entries in the interpreter, their partials added
    by the reduction kernel), rows cut at a -1 and listing entries past the causal limit or below -1 (masked out); two
    calls give the same bits. Index values unvalidated, as on a GPU."""
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
    rows = [[0, -1, 1], [1, 0, 5], [0, 2, 1], [3, 0, -1], [0, 4, 1], [5, 0, 2], [6, -7, 0]]
    x = _inputs([7], [7], F, 3, rows=[rows], seed=4)
    first, second = _run(x, "TND"), _run(x, "TND")
    assert triton_backend == KERNELS * 2
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    _check(first, x, "TND", F, 3)


def test_device_lengths_give_the_host_paths_results(triton_backend):
    """Lengths left to the kernels (the call as the operator builds it for device lengths: nothing read on the host)
    give the bits of the host path's uploaded lengths."""
    x = _inputs([3, 4], [5, 4], F, 4, seed=9)
    args, kw = _packed(x, "TND")
    lens = {name: kw.pop(name).to(DEVICE) for name in ("actual_seq_qlen", "actual_seq_klen")}
    call = kl_loss_call(*args, **kw, **lens, sparse_mode=3)
    device_call = dataclasses.replace(call, host=None, device_values=("actual_seq_lengths_query", "actual_seq_klen"))
    rope = (kw["query_rope"], kw["key_rope"])
    host = kl_launch.kl_loss_for(call, *args, *rope, scale=SCALE)
    device = kl_launch.kl_loss_for(device_call, *args, *rope, scale=SCALE)
    for a, b in zip(host, device):
        assert torch.equal(a, b)
    assert triton_backend == KERNELS * 2
