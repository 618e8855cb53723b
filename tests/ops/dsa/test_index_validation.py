"""Block tables and index rows of the DSA operators: bad values are named errors with validation on (the CPU
default), and masked out with ``ATTNOPS_VALIDATE=0`` (compared with the fp64 golden of that effect)."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops import torch_npu
from attnops._core.errors import ParamInvalidError
from attnops.ops.dsa.quant_cache import ROW_BYTES
from attnops.testing import golden_dsa as G
from attnops.testing.compare import assert_close_to_golden, kl_reductions, sfa_reductions

from .dsa_helpers import pack_keys, randn


@pytest.fixture
def validation_off(monkeypatch):
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")


def _paged_indexer(table, k_len=20, count=32):
    q, w, k = randn(1, 1, 2, 8, seed=1), randn(1, 1, 2, seed=2).abs(), randn(4, 16, 1, 8, seed=3)
    res = attnops.lightning_indexer(q, k, w, sparse_count=count, layout_key="PA_BSND",
                                    block_table=torch.tensor(table, dtype=torch.int32),
                                    actual_seq_lengths_key=[k_len])
    return res.sparse_indices.flatten().tolist(), (q, w, k)


@pytest.mark.parametrize("bad", [-1, -3, 4, 100])
def test_indexer_block_id_inside_the_length_is_an_error(bad):
    with pytest.raises(ParamInvalidError, match=rf"^block_table: expected a block id in \[0, 4\) .*, got "
                                                rf"block_table\[0, 1\] = "
                                                rf"{bad}, but batch 0 has 20 tokens .*which need 2 blocks of 16$"):
        _paged_indexer([[0, bad]])


def test_indexer_entries_past_the_length_are_not_read():
    assert _paged_indexer([[2, 3, -1, 77]], k_len=20)[0] == _paged_indexer([[2, 3, 0, 0]], k_len=20)[0]


@pytest.mark.parametrize("bad", [-1, 4])
def test_indexer_unvalidated_block_contributes_no_keys(validation_off, bad):
    got, (q, w, k) = _paged_indexer([[0, bad]])
    want = G.lightning_indexer(q[0], k.flatten(0, 1)[:20, 0], w[0], 32, 3, masked=frozenset(range(16, 20)))
    assert got == want[0]
    assert sorted(v for v in got if v >= 0) == list(range(16))  # not the block-0 keys read twice


def _sfa(rows, *, k_len=12, mode=3, table=None, block=1):
    q, k = randn(1, 1, 2, 8, seed=4), randn(1, k_len, 1, 8, seed=5)
    kw = {}
    if table is not None:
        (k,), lens, _ = pack_keys([[k[0, :, 0]]], "PA_BSND", block_size=16)
        kw = dict(layout_kv="PA_BSND", block_table=torch.tensor(table, dtype=torch.int32),
                  actual_seq_lengths_kv=lens)
    idx = torch.tensor(rows, dtype=torch.int32).view(1, 1, 1, -1)
    out = attnops.sparse_flash_attention(q, k, k, idx, scale=0.5, sparse_mode=mode, sparse_block_size=block, **kw)
    return out.attention_out[0, 0], q[0], k


def _golden(q, keys, rows, mode=3):
    g = G.sparse_flash_attention(q, keys, keys, [rows], 0.5, sparse_mode=mode)[0][0]
    b = G.sparse_flash_attention(q, keys, keys, [rows], 0.5, sparse_mode=mode, dtype=torch.float32)[0][0]
    return g, b


def test_sfa_negative_entry_other_than_padding_is_an_error():
    with pytest.raises(ParamInvalidError, match=r"^sparse_indices: expected an index in \[0, 12\) .*, got "
                                                r"sparse_indices\[0, 0, 0, 1\] = -2$"):
        _sfa([7, -2, 9, 10])


def test_sfa_unvalidated_negative_entry_is_skipped_and_the_row_goes_on(validation_off):
    out, q, k = _sfa([7, -2, 9, 10])
    g, b = _golden(q, k[0, :, 0], [7, -2, 9, 10])
    assert_close_to_golden("out", out, g, b, reduction=sfa_reductions([1], 2, 8, 0, 4)["out"])
    g_one, _ = _golden(q, k[0, :, 0], [7])
    assert not torch.allclose(out.double(), g_one)  # keys 9 and 10 count: -2 does not end the row


@pytest.mark.parametrize("mode", [0, 3])
def test_sfa_index_past_the_key_length_is_an_error(mode):
    with pytest.raises(ParamInvalidError, match=r"expected an index in \[0, 12\) .*, got sparse_indices\[0, "
                                                r"0, 0, 2\] = 12$"):
        _sfa([3, 5, 12, -1], mode=mode)


def test_sfa_index_past_the_sparse_blocks_is_an_error():
    with pytest.raises(ParamInvalidError, match=r"expected an index in \[0, 3\) .*, got sparse_indices\[0, "
                                                r"0, 0, 1\] = 3$"):
        _sfa([0, 3], block=4)


def test_sfa_unvalidated_index_past_the_key_length_is_masked(validation_off):
    out, q, k = _sfa([3, 5, 12, 40], mode=0)
    g, b = _golden(q, k[0, :, 0], [3, 5, 12, 40], mode=0)
    assert_close_to_golden("out", out, g, b, reduction=sfa_reductions([1], 2, 8, 0, 4)["out"])
    g_kept, _ = _golden(q, k[0, :, 0], [3, 5], mode=0)
    torch.testing.assert_close(g, g_kept)  # the golden masks them: 12 and 40 give no key (no clamp to 11)


def test_sfa_block_id_past_the_cache_is_an_error():
    with pytest.raises(ParamInvalidError, match=r"got block_table\[0, 0\] = 9, but batch 0 has 12 tokens"):
        _sfa([3, 5], table=[[9]])


def test_sfa_unvalidated_block_past_the_cache_contributes_nothing(validation_off):
    out, q, _ = _sfa([3, 5], table=[[9]])
    assert torch.equal(out, torch.zeros_like(out))


def test_quant_sfa_block_table_is_validated():
    query = randn(1, 1, 2, 576, seed=6).half()
    cache = torch.zeros(2, 16, 1, ROW_BYTES, dtype=torch.int8)
    idx = torch.tensor([0, 1, -1], dtype=torch.int32).view(1, 1, 1, -1)
    with pytest.raises(ParamInvalidError, match=r"got block_table\[0, 0\] = -1, but batch 0 has 4 tokens"):
        torch_npu.npu_kv_quant_sparse_flash_attention(query, cache, cache, idx, 0.1, 2, 2, layout_kv="PA_BSND",
                                                      attention_mode=2,
                                                      block_table=torch.tensor([[-1]], dtype=torch.int32),
                                                      actual_seq_lengths_kv=torch.tensor([4], dtype=torch.int32))


def _kl(rows):
    s, heads, ni, d, di = 5, 2, 2, 8, 4
    q, kk = randn(s, heads, d, seed=1), randn(s, d, seed=3)
    qi, ki, w = randn(s, ni, di, seed=5), randn(s, di, seed=6), randn(s, ni, seed=7).abs()
    good = [[j for j in r if 0 <= j <= i] for i, r in enumerate(rows)]
    _, row_max, row_sum = G.sparse_flash_attention(q, kk, kk, good, 0.25)
    leaves = [t.clone().requires_grad_() for t in (qi[None], ki[None, :, None], w[None])]
    loss = attnops.lightning_indexer_kl_loss(q[None], kk[None, :, None], *leaves,
                                             torch.tensor(rows, dtype=torch.int32)[None, :, None],
                                             row_max[None, None].float(), row_sum[None, None].float(), scale=0.25)
    loss.sum().backward()
    golden = G.indexer_kl_loss_grad(q, kk, qi, ki, w, rows, row_max, row_sum, 0.25)
    base = G.indexer_kl_loss_grad(q, kk, qi, ki, w, rows, row_max.float(), row_sum.float(), 0.25, dtype=torch.float32)
    return loss, leaves, golden, base


KL_ROWS = [[0, -1], [1, 0], [0, -4], [7, 2], [4, 1]]


def test_kl_loss_bad_entries_are_errors():
    with pytest.raises(ParamInvalidError, match=r"expected an index in \[0, 5\) .*, got sparse_indices\[0, "
                                                r"2, 0, 1\] = -4$"):
        _kl(KL_ROWS)
    with pytest.raises(ParamInvalidError, match=r"got sparse_indices\[0, 3, 0, 0\] = 7$"):
        _kl([r if i != 2 else [0, -1] for i, r in enumerate(KL_ROWS)])


def test_kl_loss_unvalidated_bad_entries_are_masked(validation_off):
    loss, leaves, golden, base = _kl(KL_ROWS)
    red = kl_reductions(len(KL_ROWS), 2, 8, 0, 2, 4, len(KL_ROWS[0]))  # _kl's shapes
    assert_close_to_golden("loss", loss[0], golden[0], base[0], reduction=red["loss"])
    for name, leaf, g, b in zip(("d_query_index", "d_key_index", "d_weights"), leaves, golden[1:], base[1:]):
        assert_close_to_golden(name, leaf.grad.reshape(g.shape), g, b, factor=3.0, reduction=red[name])
