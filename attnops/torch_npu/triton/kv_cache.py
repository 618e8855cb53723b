"""The paged-KV-cache write (token rows copied to their cache slots) and read (the tokens of consecutive sequences
copied out of their blocks), bit for bit. No allocation here (``launch.py`` plans the launches).

A cache is addressed as a 4-D ``[num_blocks, chunks, block_size, X]`` view (ND: ``chunks = 1``, ``X = N*D``; NZ:
``X`` elements per chunk): element ``h`` of the token at slot ``s`` lives at ``[s // block_size, h // X,
s % block_size, h % X]``. Elements are moved as same-width integers, so every dtype copies exactly.
"""
import triton
import triton.language as tl


@triton.jit
def _write_row(rows_ptr, row_stride, cache_ptr, c_sb, c_sc, c_so, c_sx, capacity, block_size, width, t, slot,
               X: tl.constexpr, TILE: tl.constexpr):
    """Copy row ``t`` of ``rows`` (``width`` elements) to ``slot`` of the cache; nothing when the slot is outside
    ``[0, capacity)`` (negative: padding; past the end: invalid)."""
    limit = tl.where((slot >= 0) & (slot < capacity), width, 0)  # elements to copy: none for a skipped slot
    block = slot // block_size
    offset = slot % block_size
    base = cache_ptr + block * c_sb + offset * c_so
    src = rows_ptr + t.to(tl.int64) * row_stride
    for start in range(0, width, TILE):
        h = start + tl.arange(0, TILE)
        keep = h < limit
        data = tl.load(src + h, mask=keep)
        tl.store(base + (h // X).to(tl.int64) * c_sc + (h % X).to(tl.int64) * c_sx, data, mask=keep)


@triton.jit
def scatter_kv_kernel(slots_ptr,
                      k_rows, k_row_stride, k_cache, k_sb, k_sc, k_so, k_sx, k_capacity, k_block_size, k_width,
                      v_rows, v_row_stride, v_cache, v_sb, v_sc, v_so, v_sx, v_capacity, v_block_size, v_width,
                      K_X: tl.constexpr, V_X: tl.constexpr, K_TILE: tl.constexpr, V_TILE: tl.constexpr):
    """Program ``(t, 0)`` writes token ``t``'s key row, ``(t, 1)`` its value row, at ``slots[t]``."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if tl.program_id(1) == 0:
        _write_row(k_rows, k_row_stride, k_cache, k_sb, k_sc, k_so, k_sx, k_capacity, k_block_size, k_width, t, slot,
                   K_X, K_TILE)
    else:
        _write_row(v_rows, v_row_stride, v_cache, v_sb, v_sc, v_so, v_sx, v_capacity, v_block_size, v_width, t, slot,
                   V_X, V_TILE)


@triton.jit
def _token_source(lens_ptr, batches, t, CUMSUM: tl.constexpr, BLOCK_B: tl.constexpr):
    """``(batch, start)`` of output token ``t``: the number of sequences that end at or before ``t`` (``batches``
    when it follows them all) and the first token of its sequence (the latest such end). ``lens`` holds per-sequence
    lengths, or with ``CUMSUM`` the cumulative ``[0, c1, c2, ...]``. Any values give ``0 <= start <= t``."""
    count = tl.full((), 0, tl.int32)
    start = tl.full((), 0, tl.int64)
    running = tl.full((), 0, tl.int64)
    for b0 in range(0, batches, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        inside = b < batches
        if CUMSUM:
            ends = tl.load(lens_ptr + 1 + b, mask=inside, other=0).to(tl.int64)
        else:
            lengths = tl.load(lens_ptr + b, mask=inside, other=0).to(tl.int64)
            ends = running + tl.cumsum(lengths, 0)
            running += tl.sum(lengths, 0)
        hit = inside & (ends <= t)
        count += tl.sum(hit.to(tl.int32), 0)
        start = tl.maximum(start, tl.max(tl.where(hit, ends, 0), 0))
    return count, start


@triton.jit
def _read_row(out_ptr, out_stride, cache_ptr, c_sb, c_sc, c_so, c_sx, block, offset, valid, width, t,
              X: tl.constexpr, TILE: tl.constexpr):
    """Row ``t`` of ``out`` = the cache row at (``block``, ``offset``), or zeros when not ``valid``."""
    src = cache_ptr + block * c_sb + offset * c_so
    dst = out_ptr + t.to(tl.int64) * out_stride
    limit = tl.where(valid, width, 0)
    for start in range(0, width, TILE):
        h = start + tl.arange(0, TILE)
        data = tl.load(src + (h // X).to(tl.int64) * c_sc + (h % X).to(tl.int64) * c_sx, mask=h < limit, other=0)
        tl.store(dst + h, data, mask=h < width)


@triton.jit
def gather_kv_kernel(lens_ptr, batches, offsets_ptr, table_ptr, table_stride, table_width, num_blocks, block_size,
                     k_out, k_out_stride, k_cache, k_sb, k_sc, k_so, k_sx, k_width,
                     v_out, v_out_stride, v_cache, v_sb, v_sc, v_so, v_sx, v_width,
                     CUMSUM: tl.constexpr, HAS_OFFSETS: tl.constexpr, BLOCK_B: tl.constexpr, K_X: tl.constexpr,
                     V_X: tl.constexpr, K_TILE: tl.constexpr, V_TILE: tl.constexpr):
    """Program ``(t, 0)`` fills output token ``t``'s key row, ``(t, 1)`` its value row, from block
    ``table[b, pos // block_size + offsets[b] // block_size]`` of its sequence ``b`` (zeros for a block outside the
    table or the cache); a token past the last sequence keeps its row."""
    t = tl.program_id(0)
    batch, start = _token_source(lens_ptr, batches, t, CUMSUM, BLOCK_B)
    if batch < batches:
        pos = t - start
        column = pos // block_size
        if HAS_OFFSETS:
            column += tl.load(offsets_ptr + batch).to(tl.int64) // block_size
        in_table = (column >= 0) & (column < table_width)
        block = tl.load(table_ptr + batch.to(tl.int64) * table_stride + column, mask=in_table, other=-1).to(tl.int64)
        valid = (block >= 0) & (block < num_blocks)
        block = tl.where(valid, block, 0)
        offset = pos % block_size
        if tl.program_id(1) == 0:
            _read_row(k_out, k_out_stride, k_cache, k_sb, k_sc, k_so, k_sx, block, offset, valid, k_width, t, K_X,
                      K_TILE)
        else:
            _read_row(v_out, v_out_stride, v_cache, v_sb, v_sc, v_so, v_sx, block, offset, valid, v_width, t, V_X,
                      V_TILE)
