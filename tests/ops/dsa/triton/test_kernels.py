"""The DSA Triton kernels through the public operators (``ATTNOPS_BACKEND=triton``: the lightning indexer's fused
scores and streaming top-k, sparse flash attention over plain and packed int8/fp8 latent caches) against the fp64
golden, in every layout pair: CUDA when there is a GPU, else Triton's CPU interpreter (fp16/fp32, tiny shapes).
Each test checks that the kernel ran (a silent fallback to the reference fails)."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.ops.dsa import op as dsa_op
from attnops.testing import golden_dsa as G
from attnops.testing.compare import assert_close_to_golden, sfa_reductions
from tests.ops.dsa.dsa_helpers import golden_sfa, pack_keys, pack_query, pack_rows, randn, random_rows, unpack_rows

from .conftest import DEVICE

pytest.importorskip("triton")

LAYOUTS = [("BSND", "BSND"), ("TND", "TND"), ("TND", "PA_BSND"), ("BSND", "PA_BSND")]
H, F = torch.float16, torch.float32


def _dev(*xs):
    return [None if x is None else x.to(DEVICE) for x in xs]


# ------------------------------------------------------------------------------------------- lightning indexer
def _check_topk(got: list[int], scores: torch.Tensor, want: list[int]) -> None:
    """Same count and -1 tail; a difference only between keys whose golden scores are within rounding of the boundary
    score; the row in descending score order."""
    n = sum(v >= 0 for v in want)
    assert sum(v >= 0 for v in got[:n]) == n and all(v == -1 for v in got[n:]), (got, want)
    if n == 0:
        return
    boundary = float(scores[want[n - 1]])
    tol = 1e-3 + 1e-2 * abs(boundary)
    assert all(abs(float(scores[j]) - boundary) <= tol for j in set(got[:n]) ^ set(want[:n])), (got, want)
    ranked = scores[torch.tensor(got[:n])]
    assert bool((ranked[:-1] >= ranked[1:] - tol).all()), got


INDEXER_CASES = [(q, k, m, F, 20) for q, k in LAYOUTS for m in (0, 3)] + [("TND", "PA_BSND", 3, H, 6),
                                                                          ("BSND", "BSND", 0, H, 6)]
FAST_INDEXER = {("BSND", "BSND", 3, F, 20), ("TND", "TND", 0, F, 20), ("TND", "PA_BSND", 3, F, 20),
                ("BSND", "PA_BSND", 0, F, 20), ("TND", "PA_BSND", 3, H, 6)}


@pytest.mark.parametrize("layout_q,layout_k,mode,dtype,count", [
    pytest.param(*c, marks=() if c in FAST_INDEXER else pytest.mark.slow) for c in INDEXER_CASES])
def test_lightning_indexer_kernel(triton_backend, layout_q, layout_k, mode, dtype, count):
    q_lens, k_lens = [5, 0, 3], [9, 4, 40]
    qs = [randn(n, 4, 16, dtype=dtype, seed=b) for b, n in enumerate(q_lens)]
    ws = [randn(n, 4, dtype=F, seed=10 + b) for b, n in enumerate(q_lens)]
    ks = [randn(n, 16, dtype=dtype, seed=20 + b) for b, n in enumerate(k_lens)]
    q, q_len = pack_query(qs, layout_q)
    w, _ = pack_query(ws, layout_q)
    k, k_len, table = pack_keys(ks, layout_k)
    value = layout_k != "PA_BSND"
    res = attnops.lightning_indexer(*_dev(q, k, w), sparse_count=count, layout=layout_q, layout_key=layout_k,
                                    actual_seq_lengths_query=q_len, actual_seq_lengths_key=k_len,
                                    block_table=None if table is None else table.to(DEVICE), sparse_mode=mode,
                                    return_value=value)
    assert triton_backend == ["indexer_topk_kernel"]
    idx = res.sparse_indices.cpu()
    assert idx.dtype == torch.int32 and idx.shape == (*q.shape[:-2], 1, count)
    got = unpack_rows(idx, layout_q, q_len.diff(prepend=q_len.new_zeros(1)) if layout_q == "TND" else q_len)[:, 0]
    vals = unpack_rows(res.sparse_values.cpu(), layout_q, q_lens)[:, 0] if value else None
    r = 0
    for qb, wb, kb in zip(qs, ws, ks):
        scores = G.lightning_scores(qb, kb, wb)
        for i, want in enumerate(G.lightning_indexer(qb, kb, wb, count, mode)):
            row = got[r].tolist()
            _check_topk(row, scores[i], want)
            if value:
                n = sum(v >= 0 for v in want)
                torch.testing.assert_close(vals[r, :n].double(), scores[i, torch.tensor(row[:n], dtype=torch.long)],
                                           atol=2e-2, rtol=2e-3)
                assert torch.isinf(vals[r, n:]).all()
            r += 1
    padding = idx[sum(q_lens):] if layout_q == "TND" else torch.cat([idx[b, n:] for b, n in enumerate(q_lens)])
    assert (padding == -1).all()


# ------------------------------------------------------------------------------------------ sparse attention
def _sfa_case(q_lens, k_lens, heads, d, dr, dtype, count, block=1, mode=3, seed=0):
    qs = [randn(n, heads, d, dtype=dtype, seed=seed + b) for b, n in enumerate(q_lens)]
    qr = [randn(n, heads, dr, dtype=dtype, seed=seed + 10 + b) for b, n in enumerate(q_lens)]
    ks = [randn(n, d, dtype=dtype, seed=seed + 20 + b) for b, n in enumerate(k_lens)]
    kr = [randn(n, dr, dtype=dtype, seed=seed + 30 + b) for b, n in enumerate(k_lens)]
    return qs, qr, ks, kr, random_rows(q_lens, k_lens, count, block=block, sparse_mode=mode, seed=seed + 40)


SHAPES = {"prefill": ([6, 1, 4], [3, 33, 20], 6), "decode": ([1, 1, 1], [50, 7, 33], 40)}


@pytest.mark.parametrize("shape,layout_q,layout_kv,mode,dtype,block,sinks", [
    *[("prefill", q, k, m, F, 1, False) for q, k in LAYOUTS for m in (0, 3)],
    ("prefill", "TND", "PA_BSND", 3, H, 1, False), ("prefill", "BSND", "BSND", 3, H, 1, True),
    ("prefill", "TND", "PA_BSND", 3, F, 4, False), ("prefill", "BSND", "BSND", 3, F, 1, True),
    ("decode", "TND", "PA_BSND", 3, F, 1, True), ("decode", "TND", "PA_BSND", 3, H, 2, False)])
def test_sparse_flash_attention_kernel(triton_backend, shape, layout_q, layout_kv, mode, dtype, block, sinks):
    """Prefill: Lq > Lk in the first batch leaves rows without keys (output 0, statistics (0, 0) or (sink, 1)).
    Decode: one token per request, few programs: each row's entries split over several, then merged."""
    q_lens, k_lens, count = SHAPES[shape]
    qs, qr, ks, kr, rows = _sfa_case(q_lens, k_lens, 20, 32, 16, dtype, count, block, mode, seed=1)
    sink = randn(20, seed=9) if sinks else None
    q, q_len = pack_query(qs, layout_q)
    q_rope, _ = pack_query(qr, layout_q)
    (k, k_rope), k_len, table = pack_keys([ks, kr], layout_kv, block_size=16)
    idx = pack_rows(rows, layout_q, q.shape[1] if layout_q == "BSND" else None)
    q_d, qr_d, k_d, kr_d, idx_d, table_d, sink_d = _dev(q, q_rope, k, k_rope, idx, table, sink)
    res = attnops.sparse_flash_attention(q_d, k_d, k_d, idx_d, scale=0.3, query_rope=qr_d, key_rope=kr_d,
                                         layout=layout_q, layout_kv=layout_kv, actual_seq_lengths_query=q_len,
                                         actual_seq_lengths_kv=k_len, block_table=table_d, sparse_block_size=block,
                                         sparse_mode=mode, sinks=sink_d)
    assert triton_backend == ["sparse_attention_kernel"] + ["sparse_attention_merge_kernel"] * (shape == "decode")
    want = golden_sfa(qs, ks, ks, rows, 0.3, q_rope=qr, k_rope=kr, sparse_mode=mode, block=block, sinks=sink)
    base = golden_sfa(qs, ks, ks, rows, 0.3, q_rope=qr, k_rope=kr, sparse_mode=mode, block=block, sinks=sink,
                      dtype=dtype)
    out = res.attention_out.cpu()
    assert out.shape == q.shape and out.dtype == dtype
    red = sfa_reductions(q_lens, 20, 32, 16, count * block, sinks=sinks)
    assert_close_to_golden("out", unpack_rows(out, layout_q, q_lens), want[0], base[0], reduction=red["out"])
    for name, stat, g, b in (("max", res.softmax_max, want[1], base[1]), ("sum", res.softmax_sum, want[2], base[2])):
        flat = stat.cpu().reshape(-1, 20) if layout_q == "TND" else stat.cpu()[:, 0]
        assert_close_to_golden(name, unpack_rows(flat, layout_q, q_lens), g, b, reduction=red[name])
    padding = out[sum(q_lens):] if layout_q == "TND" else torch.cat([out[b, n:] for b, n in enumerate(q_lens)])
    assert (padding == 0).all()


def test_sparse_attention_kernel_separate_value_without_rope(triton_backend):
    q_lens, k_lens = [4, 5], [7, 12]
    qs, _, ks, _, rows = _sfa_case(q_lens, k_lens, 3, 32, 8, F, 5, seed=3)
    vs = [randn(n, 16, dtype=F, seed=50 + b) for b, n in enumerate(k_lens)]
    q, q_len = pack_query(qs, "TND")
    k, k_len, _ = pack_keys(ks, "TND")
    v, _, _ = pack_keys(vs, "TND")
    res = attnops.sparse_flash_attention(*_dev(q, k, v, pack_rows(rows, "TND")), scale=0.2, layout="TND",
                                         layout_kv="TND", actual_seq_lengths_query=q_len, actual_seq_lengths_kv=k_len)
    assert triton_backend == ["sparse_attention_kernel"] and res.attention_out.shape == (9, 3, 16)
    want = golden_sfa(qs, ks, vs, rows, 0.2)
    base = golden_sfa(qs, ks, vs, rows, 0.2, dtype=F)
    assert_close_to_golden("out", res.attention_out.cpu(), want[0], base[0],
                           reduction=sfa_reductions(q_lens, 3, 32, 0, 5)["out"])


def _packed(nope: torch.Tensor, rope: torch.Tensor, codes: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed 656-byte rows of ``[.., 512]`` latents with per-128-column scales, and the latents they decode to
    (codes x scales, independent of the package's quantizer)."""
    tiles = nope.float().unflatten(-1, (4, 128))
    scale = tiles.abs().amax(-1) / (127.0 if codes == torch.int8 else 448.0)
    code = (tiles / scale[..., None])
    code = code.round().clamp(-128, 127).to(torch.int8) if codes == torch.int8 else code.to(codes)
    rows = torch.cat([code.flatten(-2).view(torch.uint8), rope.contiguous().view(torch.uint8),
                      scale.contiguous().view(torch.uint8)], -1).view(codes)
    return rows, (code.double() * scale.double()[..., None]).flatten(-2)


@pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_quantized_cache_kernel(triton_backend, codes):
    """Packed rows dequantized in the kernel (rounded to the query dtype, as the reference does)."""
    q_lens, k_lens = [3, 2], [20, 37]
    heads, dtype = 16, H
    qs, qr, _, _, rows = _sfa_case(q_lens, k_lens, heads, 512, 64, dtype, 8, seed=5)
    latents = [randn(n, 512, dtype=F, seed=60 + b) for b, n in enumerate(k_lens)]
    ropes = [randn(n, 64, dtype=dtype, seed=70 + b) for b, n in enumerate(k_lens)]
    packed = [_packed(n, r, codes) for n, r in zip(latents, ropes)]
    key, k_len, table = pack_keys([p[0] for p in packed], "PA_BSND", block_size=16)
    nope = [p[1].to(dtype) for p in packed]
    q, q_len = pack_query([torch.cat([a, b], -1) for a, b in zip(qs, qr)], "TND")
    key_d, = _dev(key)
    out, _, _ = dsa_op.dsa_kv_quant_sparse_flash_attention(
        *_dev(q), key_d, key_d, *_dev(pack_rows(rows, "TND")), None, *_dev(table), q_len, k_len, 0.05, 1, "TND",
        "PA_BSND", 3, 64)
    assert triton_backend == ["sparse_attention_kernel"] and out.shape == (5, heads, 512)
    want = golden_sfa(qs, nope, nope, rows, 0.05, q_rope=qr, k_rope=ropes)
    base = golden_sfa(qs, nope, nope, rows, 0.05, q_rope=qr, k_rope=ropes, dtype=dtype)
    assert_close_to_golden("out", out.cpu(), want[0], base[0],
                           reduction=sfa_reductions(q_lens, heads, 512, 64, 8)["out"])
