"""A job's one-call tiles of the chunked CPU engine on its bf16 products (tiles without explicit mask, pse, dropout
or softcap), all in one C call (``cpu_kernels/gemm_bf16.cpp``): :class:`BackwardTiles` and :class:`ForwardTiles`
collect the tiles as rows of ints and run them in their order, each tile the products and passes the engine would
make one by one (so the same bits), without taking the GIL between tiles; the Python left per tile is integer
arithmetic. The operands are checked once per job, here (dtypes, unit column strides); the C walkers check every
row of a table against the operands' shapes before any write.
"""
from __future__ import annotations

import torch

from .bf16_gemm import GRAD_MAX_K, bound_library
from .fused_softmax import band_args

BF16, F32 = torch.bfloat16, torch.float32


class _TileTable:
    """The table of a job's tiles and the operands its C walker (``entry``) reads: rows added by the subclasses,
    the most rows and entries of a tile (for the workspaces), the operands as ``View``s (``_view``)."""

    def __init__(self, entry: str, operands, args: tuple):
        self._entry, self._args = entry, args
        self._views = [x for t, dtype in operands for x in _view(t, dtype)]
        self._rows: list[tuple[int, ...]] = []
        self._rmax = self._area = 0

    def _add(self, row: tuple[int, ...], r: int, c: int) -> None:
        self._rows.append(row)
        self._rmax, self._area = max(self._rmax, r), max(self._area, r * c)

    def _run(self, operands, work) -> None:
        """The tiles added since the last run in one call, with the ``operands`` of this run and the ``work``spaces
        (dense, of the dtypes they are asked in)."""
        views = torch.tensor(self._views + [x for t, dtype in operands for x in _view(t, dtype)]
                             + [x for w in work for x in (w.data_ptr(), 1, 1, w.numel(), 0, w.numel())],
                             dtype=torch.int64)
        table = torch.tensor(self._rows, dtype=torch.int64)
        code = getattr(bound_library(), self._entry)(len(self._rows), table.data_ptr(), views.data_ptr(), *self._args)
        self._rows, self._rmax, self._area = [], 0, 0
        if code:
            raise RuntimeError(f"{self._entry} returned {code}")


def _view(t: torch.Tensor, dtype: torch.dtype) -> list[int]:
    """``t`` (1 to 3 dims, ``dtype``, unit column stride) as the C walkers take an operand (``View``): address,
    heads, rows, columns, head stride, row stride."""
    if t.dtype != dtype or not 1 <= t.dim() <= 3 or (t.shape[-1] > 1 and t.stride(-1) != 1):
        raise ValueError(f"bf16 tiles: an operand {tuple(t.shape)} {t.dtype} strides {t.stride()}: expected 1 to 3 "
                         f"dims in {dtype} with unit column stride")
    shape, strides = (1,) * (3 - t.dim()) + tuple(t.shape), (0,) * (3 - t.dim()) + t.stride()
    if t.dim() == 1:
        strides = (0, t.shape[0], 1)
    # a dimension of size 1 has any stride: the dense one instead (a single row of an [Sq, 1] vector is consecutive)
    strides = tuple(shape[2] * (shape[1] if i == 0 else 1) if shape[i] == 1 else strides[i] for i in range(2))
    return [t.data_ptr(), *shape, *strides]


class BackwardTiles(_TileTable):
    """A backward job's one-call tiles (the query heads of one KV head: row chunks x column blocks) in one call
    (``attnops_bf16_backward_tiles``): per tile ``s = alpha Q K^T`` masked by the tile's band, P with its bf16 copy,
    ``tv += dy^T P``, ``dS = P (dy V^T - delta)`` rounded, ``dq += alpha dS K``, ``tk += alpha Q^T dS``, each
    chunk's Q and dy rows staged and transposed in C.

    Operands: bf16 ``q`` ``[G, Sq, d]``, ``dy`` ``[G, Sq, dv]`` (``dv <= GRAD_MAX_K``), ``k`` ``[Skv, d]``, ``v``
    ``[Skv, dv]``; fp32 ``m``, ``neg_log2_l``, ``delta`` ``[G, Sq, 1]`` (consecutive rows), ``dq`` ``[G, Sq, d]``,
    and at :meth:`run` ``tk`` ``[d, W]`` and ``tv`` ``[dv, W]``; unit column strides. ``fp32``/``bf16``: the
    thread's workspaces."""

    def __init__(self, q: torch.Tensor, dy: torch.Tensor, m: torch.Tensor, neg_log2_l: torch.Tensor,
                 delta: torch.Tensor, dq: torch.Tensor, k: torch.Tensor, v: torch.Tensor, unit_zero: bool,
                 alpha: float, fp32, bf16):
        if not 0 < dy.shape[-1] <= GRAD_MAX_K:
            raise ValueError(f"bf16 backward tiles: dy {tuple(dy.shape)}: expected a head dim of 1 to {GRAD_MAX_K}")
        super().__init__("attnops_bf16_backward_tiles", ((q, BF16), (dy, BF16), (m, F32), (neg_log2_l, F32),
                                                         (delta, F32), (dq, F32), (k, BF16), (v, BF16)),
                         (int(unit_zero), alpha))
        self._dims, self._work = (q.shape[-1], dy.shape[-1]), (fp32, bf16)

    def add(self, h: int, r0: int, r1: int, c0: int, c1: int, band: tuple[int, int, int] | None, tcol: int) -> None:
        """The tile of head ``h`` (of the ``G``), rows ``r0:r1`` and keys ``c0:c1``, masked by ``band`` (its
        ``MaskSpec.tile_band``; None: no band); its dK^T/dV^T sums go to columns ``tcol:tcol + c1 - c0``."""
        r, c = r1 - r0, c1 - c0
        self._add((h, r0, r1, c0, c1, *band_args(band, r, c), tcol), r, c)

    def run(self, tk: torch.Tensor, tv: torch.Tensor) -> None:
        """The tiles added since the last run, in one call, with their dK^T/dV^T sums into ``tk``/``tv``."""
        if not self._rows:
            return
        (d, dv), (fp32, bf16), rmax, area = self._dims, self._work, self._rmax, self._area
        self._run(((tk, F32), (tv, F32)), (
            fp32.get("s", area), bf16.get("p", area), bf16.get("ds", area), bf16.get("q", rmax * d),
            bf16.get("qt", rmax * d), bf16.get("dy", rmax * dv), bf16.get("dyt", rmax * dv)))


class ForwardTiles(_TileTable):
    """A forward job's column blocks (row chunks of one query head) in one call (``attnops_bf16_forward_tiles``):
    per block ``s = alpha Q K^T`` masked by its band, the online softmax's block on it with P rounded, the first
    block of a chunk ``O = P V`` (``m``/``l`` start there), a later one ``O = O * rescale + P V``.

    Operands: bf16 ``q`` ``[Sq, d]``, ``k`` ``[Skv, d]``, ``v`` ``[Skv, dv]``; fp32 ``m``, ``l`` ``[Sq, 1]``
    (consecutive rows) and at :meth:`run` ``o`` ``[rows, dv]``; unit column strides. ``fp32``/``bf16``: the
    thread's workspaces."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor, l: torch.Tensor,
                 alpha: float, fp32, bf16):
        super().__init__("attnops_bf16_forward_tiles", ((q, BF16), (k, BF16), (v, BF16), (m, F32), (l, F32)),
                         (alpha,))
        self._dims, self._work = (q.shape[-1], v.shape[-1]), (fp32, bf16)

    def add(self, r0: int, r1: int, c0: int, c1: int, band: tuple[int, int, int] | None, first: bool, clamp: bool,
            orow: int) -> None:
        """The block of rows ``r0:r1`` and keys ``c0:c1``, masked by ``band`` (its ``MaskSpec.tile_band``; None: no
        band): the ``first`` of its rows (``clamp``: see ``fused_softmax.softmax_block_``) or the next one of the
        rows of the block before it; its output rows are rows ``orow:orow + r1 - r0`` of :meth:`run`'s ``o``."""
        r, c = r1 - r0, c1 - c0
        self._add((r0, r1, c0, c1, *band_args(band, r, c), int(first), int(clamp), orow), r, c)

    def run(self, o: torch.Tensor) -> None:
        """The blocks added since the last run, in one call, with their outputs (before the division by ``l``) in
        ``o``."""
        if not self._rows:
            return
        (d, dv), (fp32, bf16), rmax, area = self._dims, self._work, self._rmax, self._area
        self._run(((o, F32),), (fp32.get("s", area), bf16.get("p", area), fp32.get("pv", rmax * dv),
                                fp32.get("rescale", rmax), bf16.get("q", rmax * d)))
