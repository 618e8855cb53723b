"""A job's one-call tiles on the bf16 products in one C call (``ops/common/bf16_tiles.py``): bit for bit the
engine's separate calls tile by tile (several heads, row chunks and column blocks, bands, strided rows, accumulator
columns at an offset), and bad operands or table rows refused before any write."""
import pytest
import torch

from attnops._core.workspace import Buffers
from attnops.ops.common import bf16_gemm, bf16_tiles, fused_softmax

BF16, F32 = torch.bfloat16, torch.float32
CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not bf16_gemm.bf16_gemm(CPU),
                                reason="no AVX512-BF16 in this CPU or the kernels library")


def _buffers():
    return dict(fp32=Buffers.acquire(F32, CPU), bf16=Buffers.acquire(BF16, CPU))


def _tile_by_tile(rows, q, dy, k, v, m, neg_log2_l, delta, unit_zero, alpha, dq, tk, tv) -> None:
    """The engine's separate calls of each backward tile of ``rows`` (as ``BackwardTiles.add`` takes them), in
    order: scores, probabilities with their bf16 copy, dV^T, dS from the dP GEMM, dQ, dK^T."""
    for h, r0, r1, c0, c1, band, tcol in rows:
        qs, dys, r, c = q[h, r0:r1], dy[h, r0:r1], r1 - r0, c1 - c0
        s = bf16_gemm.gemm_(torch.empty(r, c), qs, k[c0:c1], b_nt=True, alpha=alpha)
        p16 = torch.empty(r, c, dtype=BF16)
        fused_softmax.probabilities_(s, m[h, r0:r1], neg_log2_l[h, r0:r1], p16, band)
        bf16_gemm.gemm_(tv[:, tcol:tcol + c], dys.t().contiguous(), p16, b_nt=False, accumulate=True)
        ds16 = bf16_gemm.grad_gemm_(torch.empty(r, c, dtype=BF16), dys, v[c0:c1], s, delta[h, r0:r1], unit_zero)
        bf16_gemm.gemm_(dq[h, r0:r1], ds16, k[c0:c1], b_nt=False, alpha=alpha, accumulate=True)
        bf16_gemm.gemm_(tk[:, tcol:tcol + c], qs.t().contiguous(), ds16, b_nt=False, alpha=alpha, accumulate=True)


def _job_operands(g: torch.Generator, heads: int, sq: int, skv: int, d: int, dv: int):
    """Random operands of a backward job: q/dy strided as in BSND (rows ``heads * D`` apart), k/v with padded rows,
    statistics and D ``[G, Sq, 1]``, and accumulators dq, tk, tv with random contents."""
    q = torch.randn(sq, heads, d, generator=g).to(BF16).transpose(0, 1)
    dy = torch.randn(sq, heads, dv, generator=g).to(BF16).transpose(0, 1)
    k = torch.randn(skv, d + 3, generator=g).to(BF16)[:, :d]
    v = torch.randn(skv, dv + 1, generator=g).to(BF16)[:, :dv]
    m = torch.rand(heads, sq, 1, generator=g) + 2.0
    neg_log2_l = -torch.rand(heads, sq, 1, generator=g) - 3.0
    delta = torch.randn(heads, sq, 1, generator=g)
    acc = (torch.randn(heads, sq, d, generator=g), torch.randn(d, skv + 5, generator=g),
           torch.randn(dv, skv + 5, generator=g))
    return dict(q=q, dy=dy, k=k, v=v, m=m, neg_log2_l=neg_log2_l, delta=delta), acc


@pytest.mark.parametrize("unit_zero", [False, True])
@pytest.mark.parametrize("d, dv", [(1, 1), (33, 20), (64, 64), (128, 256)])
def test_backward_tiles(d, dv, unit_zero):
    """A backward job's tiles in one call equal the separate calls tile by tile: several heads and row chunks (each
    staged and transposed once), column blocks of a chunk adding into the same dQ rows, tiles with and without a
    band, dK^T/dV^T columns at an offset; a run with no tile does nothing."""
    g = torch.Generator().manual_seed(d + dv)
    ops, acc = _job_operands(g, 2, 70, 300, d, dv)
    rows = [(0, 0, 13, 0, 130, None, 0), (0, 0, 13, 130, 300, (-13, 20, 5), 130), (1, 0, 13, 0, 300, None, 2),
            (1, 13, 70, 0, 1, (-57, 1, 0), 4), (0, 13, 70, 7, 200, (-40, 5, 2), 0), (0, 13, 70, 200, 300, None, 200),
            (1, 69, 70, 299, 300, (-1, 0, 0), 299)]
    got = [t.clone() for t in acc]
    tiles = bf16_tiles.BackwardTiles(**ops, dq=got[0], unit_zero=unit_zero, alpha=0.125, **_buffers())
    tiles.run(got[1], got[2])
    assert all(torch.equal(a, b) for a, b in zip(got, acc))
    for row in rows:
        tiles.add(*row)
    tiles.run(got[1], got[2])
    _tile_by_tile(rows, *ops.values(), unit_zero, 0.125, *acc)
    for a, b in zip(got, acc):
        assert torch.equal(a, b)


def test_backward_tiles_refuse_bad_operands():
    """Operands of the wrong dtype or column stride, or a head dim past the dS GEMM's block, raise at once; a table
    row outside its operands (rows, keys, accumulator columns, head, band) fails the call before any write."""
    ops, (dq, tk, tv) = _job_operands(torch.Generator().manual_seed(0), 2, 40, 100, 16, 16)

    def tiles(**kw):
        return bf16_tiles.BackwardTiles(**{**ops, "dq": dq, "unit_zero": False, "alpha": 0.125, **_buffers(), **kw})

    with pytest.raises(ValueError, match="bf16 tiles: an operand .* unit column stride"):
        tiles(q=ops["q"].float())
    with pytest.raises(ValueError, match="bf16 tiles: an operand"):
        tiles(k=ops["k"].t())
    with pytest.raises(ValueError, match="head dim of 1 to 256"):
        tiles(dy=torch.zeros(2, 40, 257, dtype=BF16))
    before = [t.clone() for t in (dq, tk, tv)]
    for bad in ((0, 0, 41, 0, 10, None, 0), (0, 0, 8, 90, 101, None, 0), (0, 0, 8, 0, 10, None, 96),
                (2, 0, 8, 0, 10, None, 0), (0, 8, 8, 0, 10, None, 0), (0, 0, 8, 0, 10, (-9, 10, 0), 0)):
        job = tiles()
        job.add(0, 0, 8, 0, 10, None, 0)  # a good tile first: nothing runs before every row is checked
        job.add(*bad)
        with pytest.raises(RuntimeError, match="attnops_bf16_backward_tiles returned 3"):
            job.run(tk, tv)
    assert all(torch.equal(a, b) for a, b in zip((dq, tk, tv), before))


def _blocks_one_by_one(rows, q, k, v, m, l, alpha, o) -> None:
    """The engine's separate calls of each forward block of ``rows`` (as ``ForwardTiles.add`` takes them), in
    order: scores, the online softmax's block with its bf16 copy, P V, the rescaled sum."""
    for r0, r1, c0, c1, band, first, clamp, orow in rows:
        r, c, dv = r1 - r0, c1 - c0, v.shape[1]
        s = bf16_gemm.gemm_(torch.empty(r, c), q[r0:r1], k[c0:c1], b_nt=True, alpha=alpha)
        p16, rescale = torch.empty(r, c, dtype=BF16), None if first else torch.empty(r, 1)
        fused_softmax.softmax_block_(s, m[r0:r1], l[r0:r1], rescale, clamp, p16, band)
        pv = bf16_gemm.gemm_(torch.empty(r, dv), p16, v[c0:c1], b_nt=False)
        if first:
            o[orow:orow + r] = pv
        else:
            o[orow:orow + r].mul_(rescale).add_(pv)


@pytest.mark.parametrize("clamp", [False, True])
@pytest.mark.parametrize("d, dv", [(1, 1), (33, 20), (128, 256), (64, 300)])
def test_forward_tiles(d, dv, clamp):
    """A forward job's blocks in one call equal the separate calls block by block: row chunks of one or several
    blocks (later ones moving the max), with and without a band, strided query rows, output rows at an offset."""
    g = torch.Generator().manual_seed(d + dv)
    q = torch.randn(60, 3, d, generator=g).to(BF16)[:, 1]
    k = torch.randn(400, d + 2, generator=g).add_(torch.linspace(0, 2, 400).unsqueeze(1)).to(BF16)[:, :d]
    v = torch.randn(400, dv, generator=g).to(BF16)
    rows = [(0, 7, 0, 70, (-7, 3, 0), True, clamp, 5), (7, 60, 0, 150, None, True, clamp, 12),
            (7, 60, 150, 300, (-53, 100, 0), False, clamp, 12), (7, 60, 300, 400, (-40, 5, 2), False, clamp, 12),
            (59, 60, 399, 400, None, True, clamp, 0)]
    m, l, o = torch.zeros(60, 1), torch.zeros(60, 1), torch.full((66, dv + 2), 4.0)
    ref_m, ref_l, ref_o = m.clone(), l.clone(), o.clone()
    tiles = bf16_tiles.ForwardTiles(q, k, v, m, l, alpha=0.125, **_buffers())
    for row in rows:
        tiles.add(*row)
    tiles.run(o[:, :dv])
    _blocks_one_by_one(rows, q, k, v, ref_m, ref_l, 0.125, ref_o[:, :dv])
    for got, want in ((m, ref_m), (l, ref_l), (o, ref_o)):
        assert torch.equal(got, want)


def test_forward_tiles_refuse_bad_tables():
    """A forward block outside its operands, or a later block that does not continue the rows before it, fails
    the call before any write."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, 16, generator=g).to(BF16) for n in (20, 50, 50))
    m, l, o = torch.zeros(20, 1), torch.zeros(20, 1), torch.zeros(20, 16)
    for bad in ((0, 21, 0, 10, None, True, False, 0), (0, 8, 45, 51, None, True, False, 0),
                (0, 8, 0, 10, None, True, False, 13), (8, 16, 10, 20, None, False, False, 8),
                (0, 8, 10, 20, None, False, False, 1)):
        job = bf16_tiles.ForwardTiles(q, k, v, m, l, alpha=0.125, **_buffers())
        job.add(0, 8, 0, 10, None, True, False, 0)
        job.add(*bad)
        with pytest.raises(RuntimeError, match="attnops_bf16_forward_tiles returned 3"):
            job.run(o)
    assert not (m.any() or l.any() or o.any())
    with pytest.raises(ValueError, match="bf16 tiles: an operand"):
        bf16_tiles.ForwardTiles(q, k, v.float(), m, l, alpha=0.125, **_buffers())
