"""``@triton.jit`` side of :mod:`attnops.ops.common.inverted_lists`: where a key-gradient program's list chunk lies."""
import triton
import triton.language as tl


@triton.jit
def list_chunk(list_start_ptr, unit_end_ptr, l, u, chunk):
    """``(lo, hi, chunks, c)``: list ``l``'s entries ``[lo, hi)`` in its chunk ``c`` of ``chunks`` (unit ``u``; every
    list has at least one chunk, an empty list one empty chunk)."""
    start = tl.load(list_start_ptr + l)
    end = tl.load(list_start_ptr + l + 1)
    chunks = tl.maximum(tl.cdiv(end - start, chunk), 1)
    c = u - (tl.load(unit_end_ptr + l) - chunks)
    lo = start + c * chunk
    return lo, tl.minimum(end, lo + chunk), chunks, c
