"""Index values of the paged KV-cache ops: named errors with validation on (CPU tensors, the default), the masked
effect with ``ATTNOPS_VALIDATE=0`` (a slot outside the cache writes nothing; the read stops at the outputs' length
and reads zeros from blocks outside the cache)."""
from __future__ import annotations

import pytest
import torch

from attnops import torch_npu
from attnops._core.errors import ParamInvalidError

BLOCKS, BLOCK, N, D = 4, 16, 2, 8


@pytest.fixture
def caches():
    g = torch.Generator().manual_seed(0)
    return torch.randn(BLOCKS, BLOCK, N, D, generator=g), torch.randn(BLOCKS, BLOCK, N, D, generator=g)


def _gather(caches, table, lens, rows, **kw):
    out = torch.zeros(rows, N, D), torch.zeros(rows, N, D)
    return torch_npu.npu_gather_pa_kv_cache_functional(*caches, torch.tensor(table, dtype=torch.int32),
                                                       torch.tensor(lens, dtype=torch.int32), *out, **kw)


def _golden_gather(cache, table, lens, rows):
    """Sequence after sequence, token by token, until the output is full; invalid blocks read zeros."""
    tokens = [cache[table[b][p // BLOCK], p % BLOCK] if 0 <= table[b][p // BLOCK] < BLOCKS else torch.zeros(N, D)
              for b, n in enumerate(lens) for p in range(n)]
    return torch.stack((tokens + [torch.zeros(N, D)] * rows)[:rows])


def test_gather_into_outputs_too_small_is_an_error(caches):
    with pytest.raises(ParamInvalidError, match=r"key: expected at least 40 rows along dim 0 \(the 40 tokens of "
                                                r"seq_lens\), got Tensor\(shape=\[30, 2, 8\]"):
        _gather(caches, [[0, 1], [2, 3]], [20, 20], 30)


@pytest.mark.parametrize("bad", [-1, -7, BLOCKS])
def test_gather_block_id_inside_the_length_is_an_error(caches, bad):
    with pytest.raises(ParamInvalidError, match=r"^block_tables: expected a block id in \[0, 4\) .*, got "
                                                r"block_tables\[1, 1\] = "
                                                rf"{bad}, but batch 1 has 20 tokens \(seq_lens\), which need 2 blocks "
                                                r"of 16$"):
        _gather(caches, [[0, 1], [2, bad]], [20, 20], 40)


def test_gather_checks_the_blocks_from_seq_offset_on(caches):
    got = _gather(caches, [[-1, 1, 2], [3, 0, -1]], [20, 3], 23, seq_offset=torch.tensor([16, 0], dtype=torch.int32))
    assert torch.equal(got[0][:20], _golden_gather(caches[0], [[1, 2]], [20], 20))
    with pytest.raises(ParamInvalidError, match=r"got block_tables\[0, 2\] = -1, .*which need 2 blocks of 16 "
                                                r"from column 1$"):
        _gather(caches, [[0, 1, -1]], [20], 20, seq_offset=torch.tensor([16], dtype=torch.int32))
    with pytest.raises(ParamInvalidError, match=r"block_tables: expected at least 3 columns"):
        _gather(caches, [[0, 1]], [20], 20, seq_offset=torch.tensor([16], dtype=torch.int32))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_unvalidated_gather_stops_at_the_outputs_and_zeros_bad_blocks(caches, monkeypatch, backend):
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
    monkeypatch.setenv("ATTNOPS_BACKEND", backend)
    table, lens = [[0, -1], [2, 3]], [20, 20]
    key, value = _gather(caches, table, lens, 30)
    assert torch.equal(key, _golden_gather(caches[0], table, lens, 30))
    assert torch.equal(value, _golden_gather(caches[1], table, lens, 30))


@pytest.mark.parametrize("bad", [-2, BLOCKS * BLOCK, 2 ** 40])
def test_write_slot_out_of_range_is_an_error(caches, bad):
    tokens = torch.randn(3, N, D)
    key_cache = caches[0].clone()
    with pytest.raises(ParamInvalidError, match=rf"^slot_mapping: expected a slot in \[0, 64\) .* or -1 .*, "
                                                rf"got slot_mapping\[1\] = {bad}$"):
        torch_npu._npu_reshape_and_cache(tokens, tokens, key_cache, caches[1].clone(), torch.tensor([0, bad, -1]))
    assert torch.equal(key_cache, caches[0])  # nothing written before the error


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_unvalidated_write_drops_slots_outside_the_cache(caches, monkeypatch, backend):
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
    monkeypatch.setenv("ATTNOPS_BACKEND", backend)
    tokens = torch.randn(4, N, D)
    key_cache, value_cache = caches[0].clone(), caches[1].clone()
    torch_npu.npu_scatter_pa_kv_cache(tokens, tokens, key_cache, value_cache, torch.tensor([5, -2, 64, 17]),
                                      cache_mode="Norm")
    want = caches[0].clone()
    want.view(-1, N, D)[5], want.view(-1, N, D)[17] = tokens[0], tokens[3]
    assert torch.equal(key_cache, want)
