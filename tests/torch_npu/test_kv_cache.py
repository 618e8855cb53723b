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
    x = 32 // dtype.itemsize  # NZ: the values in 32 bytes
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
    with pytest.raises(ValueError, match=r"^slot_mapping: expected a slot in \[0, 20\) .*, got "
                                         r"slot_mapping\[6\] = 20$"):
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
    invalid id and the row's end (zeros); ``tokens`` 18 leaves the rows past the last sequence (15) as they were.
    Values not validated: the masked effect of the invalid id, the row's end and the short output (9)."""
    monkeypatch.setenv("ATTNOPS_BACKEND", backend)
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
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
    """Into non-contiguous outputs (written back through a copy), with more sequences than one scan step holds;
    values not validated (random block ids, more tokens than rows)."""
    monkeypatch.setattr(cache_launch, "MAX_BATCH_TILE", 16)
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
    caches = _caches(layout, dtype, 14)
    lens = torch.tensor([1, 0, 2] * 8 + [1], dtype=torch.int64)  # 25 sequences, 25 tokens into 20 rows
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


# --- goldens of op-plugin's tests, layouts from the shapes, mixed dtypes, validation before writing ---------------

def _golden_write(cache, tokens, slots, nz):
    """op-plugin's loop: each token with a non-negative slot copied to its row (NZ: ``x``-wide chunks of its
    flattened ``[N*D]`` row, one per chunk index)."""
    out = cache.clone()
    block_size = cache.shape[2] if nz else cache.shape[1]
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, row = divmod(slot, block_size)
        if nz:
            x = cache.shape[-1]
            for k, chunk in enumerate(tokens[t].reshape(-1, x)):
                out[block, k, row] = chunk
        else:
            out[block, row] = tokens[t].reshape(out[block, row].shape)
    return out


def _nz_from_nd(cache):
    """The NZ ``[num_blocks, N*D/x, block_size, x]`` cache holding the rows of an ND ``[num_blocks, block_size, N,
    D]`` cache."""
    x = 32 // cache.element_size()
    return cache.flatten(2).unflatten(2, (-1, x)).transpose(1, 2).contiguous()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_reshape_and_cache_int8_key_bf16_value_nz_like_op_plugins_int8_test(monkeypatch, backend):
    """op-plugin's ``test_reshape_and_cache_int8``: an int8 key [T, 1, 512] and a bf16 value [T, 1, 64] written into
    NZ caches [8, 16, 128, 32] (int8) and [8, 4, 128, 16] (bf16) (the interpreter copies bf16 as 16-bit integers)."""
    monkeypatch.setenv("ATTNOPS_BACKEND", backend)
    g = torch.Generator().manual_seed(30)
    key = torch.randint(-128, 128, (14, 1, 512), generator=g, dtype=torch.int8)
    value = torch.rand(14, 1, 64, generator=g).to(torch.bfloat16)
    key_cache = torch.randint(-128, 128, (8, 16, 128, 32), generator=g, dtype=torch.int8)
    value_cache = torch.rand(8, 4, 128, 16, generator=g).to(torch.bfloat16)
    slots = torch.randperm(8 * 128, generator=g)[:14].to(torch.int32)
    want_key, want_value = (_golden_write(c, x, slots, nz=True) for c, x in ((key_cache, key), (value_cache, value)))
    torch_npu._npu_reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_key)
    assert torch.equal(value_cache.view(torch.int16), want_value.view(torch.int16))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("cache_mode", ["PA_NZ", "Norm"])
def test_scatter_of_mixed_key_and_value_dtypes(monkeypatch, backend, cache_mode):
    monkeypatch.setenv("ATTNOPS_BACKEND", backend)
    key, value = _tokens(torch.int8, D, 31), _tokens(torch.float16, DV, 32)
    nz = cache_mode == "PA_NZ"
    key_cache = (randn(BLOCKS, BLOCK, N, D, seed=33) * 40).to(torch.int8)
    value_cache = randn(BLOCKS, BLOCK, N, DV, seed=34).half()
    if nz:
        key_cache, value_cache = _nz_from_nd(key_cache), _nz_from_nd(value_cache)
    slots = torch.tensor([6, -1, 19, 0, 13, 2, 4])
    want = [_golden_write(c, x, slots, nz) for c, x in ((key_cache, key), (value_cache, value))]
    torch_npu.npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slots, cache_mode=cache_mode)
    assert torch.equal(key_cache, want[0]) and torch.equal(value_cache, want[1])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_scatter_without_cache_mode_writes_an_nd_cache(monkeypatch, backend):
    """vllm-ascend writes its ND ``[num_blocks, block_size, N, D]`` caches without cache_mode ("PA_NZ" by default):
    the shapes fit ND only, so the call is the "Norm" one (CANN picks the scenario from the shapes)."""
    monkeypatch.setenv("ATTNOPS_BACKEND", backend)
    key, value = _tokens(torch.float16, D, 35), _tokens(torch.float16, DV, 36)
    caches = _caches("nd4", torch.float16, 37)
    slots = torch.tensor([6, -1, 19, 0, 13, 2, 4])
    default = tuple(c.clone() for c in caches)
    torch_npu.npu_scatter_pa_kv_cache(key, value, *default, slots)
    norm = torch_npu.npu_scatter_pa_kv_cache_functional(key, value, *caches, slots, cache_mode="Norm")
    assert torch.equal(default[0], norm[0]) and torch.equal(default[1], norm[1])
    assert torch.equal(norm[0], _golden_write(caches[0], key, slots, nz=False))


def test_a_shape_that_fits_both_layouts_follows_cache_mode():
    """[num_blocks, 2, 2, 16] fp16 with N=2, D=16 is ND (block_size 2) and NZ (N*D/16 = 2 chunks of x=16): "PA_NZ"
    writes NZ, "Norm" (and the ops without cache_mode) ND."""
    key = randn(3, 2, 16, seed=38).half()
    cache = randn(4, 2, 2, 16, seed=39).half()
    slots = torch.tensor([0, 5, 3])
    nz = torch_npu.npu_scatter_pa_kv_cache_functional(key, key, cache, cache, slots)[0]
    nd = torch_npu.npu_scatter_pa_kv_cache_functional(key, key, cache, cache, slots, cache_mode="Norm")[0]
    assert torch.equal(nz, _golden_write(cache, key, slots, nz=True))
    assert torch.equal(nd, _golden_write(cache, key, slots, nz=False))
    written = cache.clone()
    torch_npu._npu_reshape_and_cache(key, key, written, written.clone(), slots)
    assert torch.equal(written, nd)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("bad", ["value_cache_blocks", "value_cache_dtype", "value_cache_shape"])
def test_nothing_is_written_when_an_argument_is_bad(monkeypatch, backend, bad):
    """Every argument is validated before the first write: a bad value cache leaves the key cache as it was."""
    monkeypatch.setenv("ATTNOPS_BACKEND", backend)
    key, value = _tokens(torch.float16, D, 40), _tokens(torch.float16, DV, 41)
    key_cache, value_cache = _caches("nd4", torch.float16, 42)
    value_cache = {"value_cache_blocks": value_cache[:2], "value_cache_dtype": value_cache.float(),
                   "value_cache_shape": value_cache[..., :DV - 1]}[bad]
    before = key_cache.clone()
    slots = torch.tensor([6, -1, 19, 0, 13, 2, 4])  # 19 fits the key cache (20 slots), not a 2-block value cache
    with pytest.raises(ValueError, match="slot_mapping|value_cache"):
        torch_npu._npu_reshape_and_cache(key, value, key_cache, value_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping|value_cache"):
        torch_npu.npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slots, cache_mode="Norm")
    assert torch.equal(key_cache, before)


def test_cache_errors_name_the_accepted_forms():
    key = randn(3, 2, 16, seed=43).half()
    with pytest.raises(ValueError, match=r"key_cache: expected a paged cache .*: NZ \[num_blocks, N\*D/16, block_size, "
                                         r"16\] .* or ND \[num_blocks, block_size, N, D\]"):
        torch_npu.npu_scatter_pa_kv_cache(key, key, torch.zeros(4, 4, 2, 8).half(), torch.zeros(4, 4, 2, 16).half(),
                                          torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="value_cache: expected dtype torch.float32 .same as value."):
        torch_npu._npu_reshape_and_cache(key, key.float(), torch.zeros(4, 4, 2, 16).half(),
                                         torch.zeros(4, 4, 2, 16).half(), torch.tensor([0, 1, 2]))


def _golden_gather(cache_rows, block_tables, lens, offsets, out):
    """op-plugin's ``gather_pa_kv_cache_nd``: tokens of consecutive sequences from their blocks
    (``block_tables[b, offset // block_size + pos // block_size]``), zeros for an id outside ``[0, num_blocks)`` or
    a position past the table, the copy stopping at ``out.shape[0]`` tokens."""
    num_blocks, block_size = cache_rows.shape[:2]
    out, t = out.clone(), 0
    for b, n in enumerate(lens):
        for pos in range(n):
            if t == out.shape[0]:
                return out
            column = offsets[b] // block_size + pos // block_size
            block = int(block_tables[b, column]) if column < block_tables.shape[1] else -1
            out[t] = cache_rows[block, pos % block_size] if 0 <= block < num_blocks else 0
            t += 1
    return out


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("layout", ["nd4", "nd3", "nz4"])
def test_gather_reads_zeros_for_block_ids_past_the_cache(monkeypatch, backend, layout):
    """op-plugin's golden (ND and NZ), values not validated: a block id >= num_blocks (or negative, or past the
    table) reads zeros."""
    monkeypatch.setenv("ATTNOPS_BACKEND", backend)
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
    rows = (randn(BLOCKS, BLOCK, N, D, seed=44), randn(BLOCKS, BLOCK, N, DV, seed=45))
    caches = {"nd4": rows, "nd3": tuple(c.flatten(2) for c in rows),
              "nz4": tuple(_nz_from_nd(c) for c in rows)}[layout]
    table = torch.tensor([[BLOCKS, 1, 2 ** 31 - 1], [3, -4, BLOCKS + 7]], dtype=torch.int32)
    lens, offsets = [9, 11], [0, 2]
    key, value = torch.full((20, N, D), 7.0), torch.full((20, N, DV), 7.0)
    got = torch_npu.npu_gather_pa_kv_cache_functional(*caches, table, torch.tensor(lens, dtype=torch.int32), key,
                                                      value, seq_offset=torch.tensor(offsets, dtype=torch.int32))
    for g, cache, out in zip(got, rows, (key, value)):
        assert torch.equal(g, _golden_gather(cache, table, lens, offsets, out))
