"""The DSA kernels with unvalidated bad index values (``ATTNOPS_VALIDATE=0``) give the documented masked effect, as
the CPU reference does: a block id outside the cache contributes no keys, a negative sparse index other than -1 is
skipped (the row goes on), an index past the key length selects nothing (no clamp)."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.testing import golden_dsa as G
from attnops.testing.compare import assert_close_to_golden, sfa_reductions
from tests.ops.dsa.dsa_helpers import pack_keys, randn

from .conftest import DEVICE

pytest.importorskip("triton")


@pytest.fixture
def validation_off(monkeypatch):
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")


@pytest.mark.parametrize("bad", [-1, 7])
def test_indexer_kernel_skips_blocks_outside_the_cache(triton_backend, validation_off, bad):
    q, w, k = randn(1, 2, 2, 16, seed=1), randn(1, 2, 2, seed=2).abs(), randn(4, 16, 1, 16, seed=3)
    res = attnops.lightning_indexer(q.to(DEVICE), k.to(DEVICE), w.to(DEVICE), sparse_count=32, layout_key="PA_BSND",
                                    block_table=torch.tensor([[2, bad]], dtype=torch.int32, device=DEVICE),
                                    actual_seq_lengths_key=[20])
    assert triton_backend == ["indexer_topk_kernel"]
    keys = k[2, :, 0]  # the positions of the missing block are never selected; their keys do not matter
    keys = torch.cat([keys, torch.zeros(4, 16)])
    want = G.lightning_indexer(q[0], keys, w[0], 32, 3, masked=frozenset(range(16, 20)))
    assert res.sparse_indices.cpu()[0, :, 0].tolist() == want


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("paged", [False, True])
def test_sparse_attention_kernel_masks_bad_entries(triton_backend, validation_off, dtype, paged):
    rows = [[7, -2, 9, 10, 12, 40, -1, 3], [-5, 0, 1, 11, 2, -1, 4, 5]]
    q, k = randn(1, 2, 4, 16, dtype=dtype, seed=4), randn(12, 16, dtype=dtype, seed=5)
    kw = {}
    if paged:
        (key,), lens, table = pack_keys([[k]], "PA_BSND", block_size=16)
        kw = dict(layout_kv="PA_BSND", block_table=table.to(DEVICE), actual_seq_lengths_kv=lens)
    else:
        key = k[None, :, None]
    idx = torch.tensor(rows, dtype=torch.int32).view(1, 2, 1, -1)
    res = attnops.sparse_flash_attention(q.to(DEVICE), key.to(DEVICE), key.to(DEVICE), idx.to(DEVICE), scale=0.3,
                                         sparse_mode=0, **kw)
    assert triton_backend == ["sparse_attention_kernel"]
    want = G.sparse_flash_attention(q[0], k, k, rows, 0.3, sparse_mode=0)
    base = G.sparse_flash_attention(q[0], k, k, rows, 0.3, sparse_mode=0, dtype=dtype)
    assert_close_to_golden("out", res.attention_out.cpu()[0], want[0], base[0],
                           reduction=sfa_reductions([2], 4, 16, 0, len(rows[0]))["out"])


def test_sparse_attention_kernel_block_outside_the_cache_contributes_nothing(triton_backend, validation_off):
    q, k = randn(1, 1, 4, 16, seed=6), randn(2, 16, 1, 16, seed=7)
    idx = torch.tensor([0, 17, 3, 20], dtype=torch.int32).view(1, 1, 1, -1)
    res = attnops.sparse_flash_attention(q.to(DEVICE), k.to(DEVICE), k.to(DEVICE), idx.to(DEVICE), scale=0.3,
                                         layout_kv="PA_BSND", sparse_mode=0,
                                         block_table=torch.tensor([[1, 5]], dtype=torch.int32, device=DEVICE),
                                         actual_seq_lengths_kv=[24])
    assert triton_backend == ["sparse_attention_kernel"]
    keys = torch.cat([k[1, :, 0], torch.zeros(8, 16)])
    want = G.sparse_flash_attention(q[0], keys, keys, [[0, 3]], 0.3, sparse_mode=0)
    base = G.sparse_flash_attention(q[0], keys, keys, [[0, 3]], 0.3, sparse_mode=0, dtype=torch.float32)
    assert_close_to_golden("out", res.attention_out.cpu()[0], want[0], base[0],
                           reduction=sfa_reductions([1], 4, 16, 0, idx.shape[-1])["out"])
