"""attnops.nn.nsa_step: the lookups of a cached NSA step equal the arithmetic they replace (page rows, compressed rows,
KV lengths, the window's rows and mask, the compressed-attention masks), at the first positions (window reaching
before position 0), across page boundaries and for chunks; the per-cache tables are reused while the block table
stands and rebuilt when it changes (another tensor, or the same one written); a replay past the pages is clamped;
RoPE from the table equals RoPE from the angles bitwise."""
from __future__ import annotations

import pytest
import torch

from attnops.nn import NativeSparseAttention
from attnops.nn.nsa_step import _tables, compressed_masks, decode_step, window_rows
from attnops.nn.rotary import apply_rotary, rotary_angles, rotary_table
from attnops.ops.nsa.step import rotate_by_table

HIDDEN, WINDOW, LOCAL = 16, 6, 2


def _cache(prefill: int, max_seq_len=None):
    torch.manual_seed(0)
    m = NativeSparseAttention(HIDDEN, 4, 2, 8, compress_block_size=8, compress_stride=4, select_block_size=8,
                              select_block_count=3, window_size=WINDOW, local_blocks=LOCAL).double()
    cache = m.new_cache(2, max_seq_len=max_seq_len, page_size=4)
    with torch.no_grad():
        m(torch.randn(2, prefill, HIDDEN, dtype=torch.float64), cache=cache)
    return cache


def _step(cache, t: int):
    """``decode_step`` of ``t`` new tokens per sequence (queries and keys of zeros: the lookups alone)."""
    q, k = torch.zeros(2 * t, 4, 8, dtype=torch.float64), torch.zeros(2 * t, 2, 8, dtype=torch.float64)
    return decode_step(cache, q, k, window=WINDOW, local_blocks=LOCAL, theta=10000.0)[0]


def _expected(cache, t: int) -> dict:
    """The indices of the next ``t`` tokens by plain arithmetic on the host (the golden of the lookups; pages
    reserved)."""
    p0 = cache.seq_len
    pos = torch.arange(p0, p0 + t)
    table = cache.block_table.long()
    rows = cache.compressed_rows()
    block, stride, ls = cache.compress_block_size, cache.compress_stride, cache.select_block_size
    keys = torch.arange(p0 - (WINDOW - 1), p0 + t)  # the window's key positions
    clamped = keys.clamp_min(0)
    i, j = torch.arange(t)[:, None], torch.arange(keys.numel())
    own = pos // ls
    cols = torch.arange(rows // (ls // stride))
    return dict(
        positions=pos.expand(2, t),
        slots=table[:, pos // cache.page_size] * cache.page_size + pos % cache.page_size,
        compressed_slots=(torch.arange(2)[:, None] * rows
                          + ((pos + 1 - block).clamp_min(0) // stride).clamp_max(rows - 1)).flatten(),
        ends=(pos + 1).repeat(2),
        window_slots=table[:, clamped // cache.page_size] * cache.page_size + clamped % cache.page_size,
        window_mask=(j < i) | (j > i + WINDOW - 1) | (keys < 0),
        atten_mask=torch.arange(rows) * stride + block - 1 > pos[:, None],
        topk_mask=(cols == 0) | ((cols <= own[:, None]) & (cols > own[:, None] - LOCAL)))


@pytest.mark.parametrize("prefill,t", [(1, 1), (3, 1), (5, 1), (15, 1), (16, 1), (22, 1), (2, 3), (13, 4)])
def test_lookups_equal_the_arithmetic(prefill, t):
    cache = _cache(prefill)
    step = _step(cache, t)  # pages reserved first
    want = _expected(cache, t)
    slots, mask = window_rows(step)
    rows = cache.compressed_rows()
    atten, topk = compressed_masks(step, rows, rows // 2, 8, 4, 8)
    got = dict(positions=step.positions, slots=step.slots, compressed_slots=step.compressed_slots, ends=step.ends,
               window_slots=slots, window_mask=mask, atten_mask=atten, topk_mask=topk)
    for name, value in want.items():
        assert torch.equal(got[name], value.to(got[name].dtype)), name
    assert cache.seq_len == prefill  # nothing appended


def test_tables_follow_the_block_table():
    cache = _cache(5)
    first = _tables(cache, WINDOW)
    assert _tables(cache, WINDOW) is first  # kept while the block table stands
    assert _tables(cache, WINDOW + 1) is not first  # one set per window
    with torch.no_grad():
        cache.block_table[:, :2] = cache.block_table[:, :2].flip(1).clone()  # written in place: its version moves
    rebuilt = _tables(cache, WINDOW)
    assert rebuilt is not first and torch.equal(_step(cache, 1).slots, _expected(cache, 1)["slots"])
    capacity = cache.capacity
    _step(cache, capacity - cache.seq_len + 1)
    assert cache.capacity > capacity and _tables(cache, WINDOW) is not rebuilt  # pages added: another block table


def test_a_replay_past_the_pages_is_clamped_into_them():
    cache = _cache(5, max_seq_len=16)
    cache.lengths.fill_(40)  # as after replays the host did not count
    step = _step(cache, 1)
    last = cache.capacity - 1
    assert step.positions.tolist() == [[last], [last]] and step.ends.tolist() == [last + 1] * 2
    slots, _ = window_rows(step)
    assert slots.max() < cache.key_pages.shape[0] * cache.page_size


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_rotary_table_equals_the_angles(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 3, 16, generator=gen, dtype=torch.float64) * 8).to(dtype)
    pos = torch.randint(0, 5000, (64,), generator=gen)
    want = apply_rotary(x, *rotary_angles(pos, 16, 10000.0, dtype))
    got = rotate_by_table(x, rotary_table(5000, 16, 10000.0, dtype, torch.device("cpu")).index_select(0, pos))
    assert torch.equal(got, want)
