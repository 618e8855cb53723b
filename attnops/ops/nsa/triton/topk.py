"""Top-k of block scores on the device (compressed attention's selection and the decode selection): per row, the
``count`` indices in descending score order, ties to the lower index (the reference's stable sort). No allocation
here (``infer_launch.py`` allocates and launches).

The producers write forced blocks at ``FLT_MAX`` and blocks a row may not choose at ``-inf``; a slot whose pick is
``-inf`` (a row with nothing to choose) gets 0. A NaN score ranks as FLT_LOWEST: below every real score, above
``-inf`` (the reference's rule). One program per row walks the row ``count`` times, ``BLOCK_W``
scores at a time: the next pick is the best entry after the previous one in (score descending, index ascending)
order, so nothing is stored between the passes and every row is handled by one program (deterministic).
"""
import triton
import triton.language as tl

from ...._core.triton.helpers import FLT_LOWEST


@triton.jit
def topk_kernel(score_ptr, out_ptr, width, count, score_row, out_row, BLOCK_W: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    w = tl.arange(0, BLOCK_W)
    none = tl.cast(width, tl.int32)  # index of "no entry"
    prev_s = tl.full([], float("inf"), tl.float32)
    prev_i = tl.full([], -1, tl.int32)
    for slot in range(count):
        best_s = tl.full([], float("-inf"), tl.float32)
        best_i = none
        for w0 in range(0, width, BLOCK_W):
            cols = w0 + w
            s = tl.load(score_ptr + row * score_row + cols, mask=cols < width, other=float("-inf"))
            s = tl.where(s != s, FLT_LOWEST, s)  # NaN ranks below every real score, above -inf
            after = (cols < width) & ((s < prev_s) | ((s == prev_s) & (cols > prev_i)))
            tile_s = tl.max(tl.where(after, s, float("-inf")), 0)
            tile_i = tl.min(tl.where(after & (s == tile_s), cols, none), 0)
            better = (tile_s > best_s) | ((tile_s == best_s) & (tile_i < best_i))
            best_i = tl.where(better, tile_i, best_i)
            best_s = tl.where(better, tile_s, best_s)
        tl.store(out_ptr + row * out_row + slot, tl.where((best_i < none) & (best_s > float("-inf")), best_i, 0))
        prev_s = best_s
        prev_i = best_i
