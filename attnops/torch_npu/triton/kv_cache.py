"""The paged-KV-cache write: token rows copied to their cache slots, bit for bit. No allocation here
(``launch.py`` plans the launch).

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
