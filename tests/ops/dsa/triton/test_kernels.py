"""The DSA Triton kernels (lightning indexer with its streaming top-k, sparse flash attention over plain and
quantized latent caches) against the fp64 formulas of ``dsa_golden``, in every layout pair: CUDA when there is a GPU,
else Triton's CPU interpreter (fp16/fp32, tiny shapes)."""
from __future__ import annotations

import pytest
import torch

from tests.ops.dsa.triton import dsa_golden as golden
from tests.ops.dsa.triton.layouts import Case

from .conftest import DEVICE

pytest.importorskip("triton")

from attnops.ops.dsa.triton import launch  # noqa: E402

CASES = {
    "bsnd": Case("BSND", "BSND", [5, 3], [20, 9], 5, 20),
    "tnd": Case("TND", "TND", [4, 0, 6], [17, 0, 40], 12, 60),
    "paged": Case("TND", "PA_BSND", [1, 3, 2], [37, 20, 1], 7, 0),
    "paged-bsnd": Case("BSND", "PA_BSND", [2, 1], [33, 5], 2, 0),
}


def _geometry(case: Case, query, key, table):
    q_lens = case.q_lengths() if case.q_layout == "TND" else torch.tensor(case.q_lens, dtype=torch.int32)
    return launch.geometry(query, key, case.q_layout, case.kv_layout, q_lens, case.kv_lengths(), table)


def _rows(case: Case, tensor: torch.Tensor, b: int) -> torch.Tensor:
    """Batch ``b``'s rows of an output in the query layout."""
    if case.q_layout == "BSND":
        return tensor[b]
    start = sum(case.q_lens[:b])
    return tensor[start:start + case.q_lens[b]]


def _padding(case: Case, tensor: torch.Tensor) -> torch.Tensor:
    """Every output row that is not a real query row, flattened."""
    if case.q_layout == "BSND":
        return torch.cat([tensor[b, case.q_lens[b]:].reshape(-1) for b in range(case.batch)])
    return tensor[sum(case.q_lens):].reshape(-1)


def _check_topk(got: list[int], scores: torch.Tensor, want: list[int]) -> None:
    """Same count; any difference only among scores within rounding of the boundary score; descending order."""
    assert len(got) == len(want), (got, want)
    if not want:
        return
    boundary = scores[want[-1]].item()
    tol = 1e-3 + 1e-2 * abs(boundary)
    for j in set(got) ^ set(want):
        assert abs(scores[j].item() - boundary) <= tol, (got, want)
    got_scores = scores[torch.tensor(got)]
    assert (got_scores[:-1] >= got_scores[1:] - tol).all(), got


@pytest.mark.parametrize("causal", [True, False], ids=["mode3", "mode0"])
@pytest.mark.parametrize("count", [8, 20])
@pytest.mark.parametrize("name", list(CASES))
def test_lightning_indexer(name, count, causal):
    case, gen = CASES[name], torch.Generator().manual_seed(1)
    heads, d = 4, 16
    query, q_rows = case.q_tensor((heads, d), gen, torch.float16)
    weights, w_rows = case.q_tensor((heads,), gen, torch.float32)
    key, k_rows, table = case.kv_tensor(d, gen, torch.float16)
    g = _geometry(case, query, key, table)
    idx, val = launch.lightning_indexer(g, query.to(DEVICE), key.to(DEVICE), weights.to(DEVICE), count, causal, True)
    idx, val = idx.cpu(), val.cpu()
    assert idx.dtype == torch.int32 and idx.shape == (*query.shape[:-2], 1, count) and val.dtype == query.dtype
    for b in range(case.batch):
        got_rows, got_vals = _rows(case, idx, b)[:, 0], _rows(case, val, b)[:, 0]
        for i in range(case.q_lens[b]):
            limit = golden.causal_limit(case.q_lens[b], case.kv_lens[b], i, causal)
            scores = golden.indexer_scores(q_rows(b)[i], k_rows(b)[:limit], w_rows(b)[i])
            want = golden.topk_row(scores, count)
            n = len(want)
            got = got_rows[i, :n].tolist()
            _check_topk(got, scores, want)
            assert (got_rows[i, n:] == -1).all() and torch.isinf(got_vals[i, n:]).all()
            torch.testing.assert_close(got_vals[i, :n].double(), scores[torch.tensor(got, dtype=torch.long)],
                                       atol=2e-2, rtol=2e-3) if n else None
    assert (_padding(case, idx) == -1).all()


def _indices(case: Case, count: int, sbs: int, gen) -> torch.Tensor:
    """Random distinct entries per row (some rows shorter than ``count``: -1 tails), in the query layout."""
    lead = (case.batch, case.s1) if case.q_layout == "BSND" else (case.s1,)
    idx = torch.full((*lead, 1, count), -1, dtype=torch.int32)
    flat = idx.view(-1, count)
    blocks = max(-(-max(case.kv_lens) // sbs), 1)
    for r in range(flat.shape[0]):
        n = int(torch.randint(0, count + 1, (), generator=gen))
        flat[r, :min(n, blocks)] = torch.randperm(blocks, generator=gen)[:n].to(torch.int32)
    return idx


def _check_attention(case, out, smax, ssum, q_rows, qr_rows, k_rows, kr_rows, v_rows, idx, scale, sbs, causal,
                     sinks, dtype):
    idx = idx.cpu()
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=1e-5, rtol=1e-5)
    for b in range(case.batch):
        rows_idx = _rows(case, idx, b)[:, 0]
        for i in range(case.q_lens[b]):
            limit = golden.causal_limit(case.q_lens[b], case.kv_lens[b], i, causal)
            want, m, l = golden.sparse_row(q_rows(b)[i], None if qr_rows is None else qr_rows(b)[i], k_rows(b),
                                           None if kr_rows is None else kr_rows(b), v_rows(b), rows_idx[i].tolist(),
                                           scale, limit, sbs, sinks)
            torch.testing.assert_close(_rows(case, out.cpu(), b)[i].double(), want, **tol)
            if smax.numel():
                stat_row = (_rows(case, smax.cpu()[0], b)[i] if case.q_layout == "TND" else smax.cpu()[b, 0, i])
                sum_row = (_rows(case, ssum.cpu()[0], b)[i] if case.q_layout == "TND" else ssum.cpu()[b, 0, i])
                torch.testing.assert_close(stat_row.double(), m, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(sum_row.double(), l, atol=1e-3, rtol=1e-3)
    assert (_padding(case, out.cpu()) == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("sbs,causal,lse,sink", [(1, True, True, False), (1, False, False, True),
                                                 (4, True, False, False)], ids=["mode3-lse", "mode0-sinks", "sbs4"])
@pytest.mark.parametrize("name", list(CASES))
def test_sparse_flash_attention(name, sbs, causal, lse, sink, dtype):
    case, gen = CASES[name], torch.Generator().manual_seed(2)
    heads, d, dr, count = 20, 32, 16, 6
    query, q_rows = case.q_tensor((heads, d), gen, dtype)
    query_rope, qr_rows = case.q_tensor((heads, dr), gen, dtype)
    key, k_rows, table = case.kv_tensor(d, gen, dtype)
    key_rope, kr_rows, _ = case.kv_tensor(dr, gen, dtype, table)
    idx = _indices(case, count, sbs, gen)
    sinks = torch.randn(heads, generator=gen) if sink else None
    g = _geometry(case, query, key, table)
    cache = launch.plain_cache(*(x.to(DEVICE) for x in (key, key, key_rope)))
    out, smax, ssum = launch.sparse_flash_attention(
        g, query.to(DEVICE), query_rope.to(DEVICE), cache, idx.to(DEVICE), 0.3, sbs, causal, lse,
        None if sinks is None else sinks.to(DEVICE))
    assert out.shape == query.shape and out.dtype == dtype and smax.shape == ssum.shape
    assert smax.shape == (((1, case.s1, heads) if case.q_layout == "TND" else (case.batch, 1, case.s1, heads))
                          if lse else (0,))
    _check_attention(case, out, smax, ssum, q_rows, qr_rows, k_rows, kr_rows, k_rows, idx, 0.3, sbs, causal, sinks,
                     dtype)


def test_sparse_attention_separate_value_without_rope():
    case, gen = CASES["tnd"], torch.Generator().manual_seed(3)
    query, q_rows = case.q_tensor((16, 32), gen, torch.float32)
    key, k_rows, _ = case.kv_tensor(32, gen, torch.float32)
    value, v_rows, _ = case.kv_tensor(16, gen, torch.float32)
    idx = _indices(case, 5, 1, gen)
    cache = launch.plain_cache(key.to(DEVICE), value.to(DEVICE), None)
    assert cache.value is not None
    out, smax, _ = launch.sparse_flash_attention(_geometry(case, query, key, None), query.to(DEVICE), None, cache,
                                                 idx.to(DEVICE), 0.2, 1, True, False)
    assert out.shape == (*query.shape[:-1], 16) and smax.shape == (0,)
    _check_attention(case, out, smax, smax, q_rows, None, k_rows, None, v_rows, idx, 0.2, 1, True, None,
                     torch.float32)
