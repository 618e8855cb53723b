"""The paged-KV-cache ops: the Triton cache write and read (through Triton's CPU interpreter) against the reference,
bit for bit, in every layout and element width; invalid slots skipped by the kernel; the read (both backends)
against a plain per-token loop, with token sources that stay in range whatever the length and table values."""
from __future__ import annotations

import pytest
import torch

from attnops import torch_npu
from attnops.torch_npu import kv_cache
from attnops.torch_npu.triton import launch as cache_launch
from tests.helpers import randn

pytest.importorskip("triton")

T, N, D, DV, BLOCKS, BLOCK = 7, 2, 32, 16, 5, 4
CPU = torch.device("cpu")


def _tokens(dtype, dims, seed):
    x = randn(T, N, dims, seed=seed) * 40
    return x.to(dtype)


def _caches(layout, dtype, seed):
    """Random (not zero) caches, so that a row written where it should not be shows."""
    x = 32 if dtype == torch.int8 else 16
    shapes = {"nd4": ((BLOCKS, BLOCK, N, D), (BLOCKS, BLOCK, N, DV)),
              "nd3": ((BLOCKS, BLOCK, N * D), (BLOCKS, BLOCK, N * DV)),
              "nz4": ((BLOCKS, N * D // x, BLOCK, x), (BLOCKS, N * DV // x, BLOCK, x)),
              "nz5": ((BLOCKS, N, D // x, BLOCK, x), (BLOCKS, 1, N * DV // x, BLOCK, x))}[layout]
    return tuple((randn(*shape, seed=seed + i) * 40).to(dtype) for i, shape in enumerate(shapes))


def _write(backend, monkeypatch, layout, key, value, caches, slots):
    monkeypatch.setenv("ATTNOPS_BACKEND", backend)
    caches = tuple(c.clone() for c in caches)
    if layout == "nd3":
        torch_npu.npu_scatter_pa_kv_cache(key, value, *caches, slots, cache_mode="Norm")
    elif layout == "nz5":
        torch_npu.npu_scatter_pa_kv_cache(key, value, *caches, slots)
    else:
        torch_npu._npu_reshape_and_cache(key, value, *caches, slots)  # layout read from the shapes
    return caches


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("layout", ["nd4", "nd3", "nz4", "nz5"])
def test_kernel_write_equals_reference_bit_for_bit(monkeypatch, dtype, layout):
    key, value = _tokens(dtype, D, 1), _tokens(dtype, DV, 2)
    caches = _caches(layout, dtype, 3)
    slots = torch.tensor([6, -1, 19, 0, 13, -1, 4], dtype=torch.int32)
    expected = _write("reference", monkeypatch, layout, key, value, caches, slots)
    written = _write("triton", monkeypatch, layout, key, value, caches, slots)
    for got, want, before in zip(written, expected, caches):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert not torch.equal(got, before)


def test_kernel_write_of_non_contiguous_tokens(monkeypatch):
    key = _tokens(torch.float16, D, 4).transpose(0, 1).contiguous().transpose(0, 1)  # strides (D, T*D, 1)
    value = _tokens(torch.float16, DV, 5)
    caches = _caches("nd4", torch.float16, 6)
    slots = torch.arange(T, dtype=torch.int64) * 2
    assert torch.equal(_write("triton", monkeypatch, "nd4", key, value, caches, slots)[0],
                       _write("reference", monkeypatch, "nd4", key, value, caches, slots)[0])


def test_kernel_skips_slots_outside_the_cache():
    """On the device nothing checks slot values: the kernel writes a slot in [0, capacity) and skips the others
    (negative: padding; too large: invalid), touching no other row."""
    cache = torch.randn(BLOCKS, 1, BLOCK, N * D)
    rows = torch.randn(4, N * D)
    capacity = BLOCKS * BLOCK
    slots = torch.tensor([capacity - 1, capacity, -1, 2 ** 40], dtype=torch.int64)
    written = cache.clone()
    cache_launch.KERNELS.run_all(cache_launch.scatter_plan(slots, rows, written, rows, written), CPU)
    expected = cache.clone()
    expected[BLOCKS - 1, 0, BLOCK - 1] = rows[0]
    assert torch.equal(written, expected)


def test_reference_rejects_slots_past_the_cache():
    key, value = _tokens(torch.float32, D, 7), _tokens(torch.float32, DV, 8)
    caches = _caches("nd4", torch.float32, 9)
    with pytest.raises(ValueError, match=r"slot_mapping: expected slots in \[0, num_blocks \* block_size = 20\)"):
        torch_npu._npu_reshape_and_cache(key, value, *caches, torch.tensor([0, 1, 2, 3, 4, 5, 20]))


def _gather_loop(cache_rows, table, lens, offsets, out):
    """Plain per-token loop: ``cache_rows(block, row)`` is a token's ``[N, D]``."""
    out = out.clone()
    t = 0
    for b, n in enumerate(lens):
        for pos in range(n):
            if t == out.shape[0]:
                return out
            column = pos // BLOCK + offsets[b] // BLOCK
            block = int(table[b, column]) if column < table.shape[1] else -1
            out[t] = cache_rows(block, pos % BLOCK) if 0 <= block < BLOCKS else 0
            t += 1
    return out


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("tokens", [9, 18])
@pytest.mark.parametrize("cumsum", [False, True])
def test_gather_equals_a_per_token_loop(monkeypatch, backend, tokens, cumsum):
    """Three sequences (one empty); sequence 0 starts one block into its table row (seq_offset 4), then meets an
    invalid id and the row's end (zeros); ``tokens`` 18 leaves the rows past the last sequence (15) as they were."""
    monkeypatch.setenv("ATTNOPS_BACKEND", backend)
    key_cache, value_cache = randn(BLOCKS, BLOCK, N, D, seed=10), randn(BLOCKS, BLOCK, N, DV, seed=11)
    table = torch.tensor([[4, 1, -1], [2, 7, 0], [3, 0, 1]], dtype=torch.int32)
    lens, offsets = [10, 0, 5], [4, 0, 0]
    seq_lens = torch.tensor([0, 10, 10, 15] if cumsum else lens, dtype=torch.int32)
    key, value = randn(tokens, N, D, seed=12), randn(tokens, N, DV, seed=13)
    got_key, got_value = torch_npu.npu_gather_pa_kv_cache_functional(
        key_cache, value_cache, table, seq_lens, key, value, seq_offset=torch.tensor(offsets, dtype=torch.int32),
        is_seq_lens_cumsum=cumsum)
    for got, cache, before in ((got_key, key_cache, key), (got_value, value_cache, value)):
        assert torch.equal(got, _gather_loop(lambda blk, row: cache[blk, row], table, lens, offsets, before))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("layout", ["nd4", "nz4", "nz5"])
def test_kernel_read_equals_reference_bit_for_bit(monkeypatch, dtype, layout):
    """Into non-contiguous outputs (written back through a copy), with more sequences than one scan step holds."""
    monkeypatch.setattr(cache_launch, "MAX_BATCH_TILE", 16)
    caches = _caches(layout, dtype, 14)
    lens = torch.tensor([1, 0, 2] * 8 + [1], dtype=torch.int64)  # 25 sequences, 17 tokens (3 rows left as they are)
    table = torch.randint(-1, BLOCKS + 1, (25, 2), generator=torch.Generator().manual_seed(15), dtype=torch.int32)
    key = (randn(N, 20, D, seed=16) * 40).to(dtype).transpose(0, 1)  # [20, N, D], rows not viewable as [20, N*D]
    value = (randn(20, N, DV, seed=17) * 40).to(dtype)
    results = []
    for backend in ("reference", "triton"):
        monkeypatch.setenv("ATTNOPS_BACKEND", backend)
        results.append(torch_npu.npu_gather_pa_kv_cache_functional(*caches, table, lens, key, value))
    for got, want in zip(*results):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_gather_token_sources_stay_in_range_for_any_values():
    """Device lengths, offsets and tables are not checked: garbage must still index inside the tensors."""
    ends = torch.tensor([5, 2, 40, -3])
    starts = torch.tensor([-7, 9, 1, 2])
    table = torch.tensor([[99, -5], [1, 2 ** 31 - 1], [0, 0], [-1, 3]])
    blocks, rows, valid, written = kv_cache._token_sources(table, ends, starts, torch.tensor([-9, 2 ** 40, 3, 0]),
                                                           50, BLOCK, BLOCKS)
    assert bool(((blocks >= 0) & (blocks < BLOCKS) & (rows >= 0) & (rows < BLOCK)).all())
    assert valid.shape == written.shape == (50,)
