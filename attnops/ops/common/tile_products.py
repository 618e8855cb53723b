"""The matrix products of the chunked CPU engine's tiles (:mod:`.reference`, :mod:`.reference_backward`), in one
of two operand types chosen per call by :func:`operand_dtype`:

- :class:`WideProducts`: operands in the compute dtype (fp32, or fp64 for fp64 inputs; fp16/bf16 inputs widened
  exactly), on :mod:`attnops._core.gemm` (oneDNN where PyTorch has it); the query rows are staged times the scale.
- :class:`Bf16Products`: bf16 inputs on a CPU with AVX512-BF16 (:mod:`.bf16_gemm`): Q, K, V and dy stay bf16; the
  probabilities P and the score gradient dS are rounded to bf16 for their products, as FlashAttention, SDPA and the
  NPU do for bf16 inputs (to nearest even; under ``precision="npu"`` the engine has already rounded them ties away,
  so the conversion is exact); every product is an exact bf16 x bf16 product summed in fp32, as the NPU's cube
  makes it, and the scale multiplies the fp32 sums, as its vector unit does. Scores, softmax, statistics and
  accumulators stay fp32.

Both sum in a fixed order, so results do not depend on the thread count. A products object serves one worker's job
(its workspaces are the thread's).
"""
from __future__ import annotations

import torch

from ..._core.gemm import add_mm_nt_, mm_nt
from ..._core.workspace import Buffers
from .bf16_gemm import GRAD_MAX_K, bf16_gemm, gemm_, grad_gemm_, transpose_
from .bf16_tiles import BackwardTiles, ForwardTiles
from .problem import FAProblem
from .reference_tiles import Keys, compute_dtype, stage_rows


def operand_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the GEMM operands of a call with ``dtype`` inputs: bf16 where :class:`Bf16Products` serves it,
    else the compute dtype."""
    if dtype == torch.bfloat16 and bf16_gemm(device):
        return torch.bfloat16
    return compute_dtype(dtype)


def tile_products(p: FAProblem, operands: torch.dtype, buf: Buffers) -> "WideProducts | Bf16Products":
    """The products of a job whose operands are ``operands`` (:func:`operand_dtype`); ``buf``: the thread's
    workspaces in the compute dtype."""
    return Bf16Products(p, buf) if operands == torch.bfloat16 else WideProducts(p, buf)


class WideProducts:
    """Products in the compute dtype (see the module docstring)."""

    def __init__(self, p: FAProblem, buf: Buffers):
        self.buf = buf
        self.q_scale, self.alpha = p.scale, 1.0  # the scale is in the staged query rows

    def keys(self, k: torch.Tensor, blocks) -> Keys:
        return Keys(k, blocks)

    def rows(self, name: str, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Rows ``x`` ([r, D], any dtype and strides) times ``scale`` as a dense operand (workspace ``name``)."""
        return stage_rows(self.buf, name, x, scale)

    def transposed(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """An operand ``x`` ([r, D]) transposed into a dense ``[D, r]`` (workspace ``name``)."""
        return self.buf.get(name, x.shape[1], x.shape[0]).copy_(x.t())

    def operand(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """A tile of the compute dtype (P, dS) as an operand: itself."""
        return x

    def rounded_tile(self, name: str, rows: int, cols: int) -> None:
        """None: the fused softmax passes need not write a bf16 copy of their tiles (see :class:`Bf16Products`)."""
        return None

    def grad_operand(self, name: str, dy: torch.Tensor, v: torch.Tensor, prob: torch.Tensor, delta: torch.Tensor,
                     unit_zero: bool) -> None:
        """None: the engine forms dP and dS as tiles (see :class:`Bf16Products`)."""
        return None

    def backward_tiles(self, *operands) -> None:
        """None: the engine makes each product of a tile (see :class:`Bf16Products`)."""
        return None

    def forward_tiles(self, *operands) -> None:
        """None: the engine makes each product of a tile (see :class:`Bf16Products`)."""
        return None

    def nt(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` (a new tensor, or ``out``)."""
        return mm_nt(x, w, out=out)

    def nn(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``x @ w`` (a new tensor, or ``out``)."""
        return mm_nt(x, w.t(), out=out)

    def add_nn_(self, acc: torch.Tensor, x: torch.Tensor, w: torch.Tensor, alpha: float = 1.0) -> None:
        """``acc += alpha * (x @ w)``."""
        add_mm_nt_(acc, x, w.t(), alpha=alpha)

    def release(self) -> None:
        """Nothing: the operands live in the caller's workspaces."""


class Bf16Products:
    """Products of bf16 operands on :mod:`.bf16_gemm` (see the module docstring)."""

    def __init__(self, p: FAProblem, buf: Buffers):
        self.buf, self.fp32 = Buffers.acquire(torch.bfloat16, buf.device), buf
        self.q_scale, self.alpha = 1.0, p.scale  # the GEMMs that read the query rows apply the scale

    def keys(self, k: torch.Tensor, blocks) -> "_Bf16Keys":
        return _Bf16Keys(k, self.alpha)

    def rows(self, name: str, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Rows ``x`` ([r, D], bf16) as a dense operand (used in place when they are); ``scale`` is ``q_scale``,
        1."""
        return stage_rows(self.buf, name, x, scale)

    def transposed(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return transpose_(self.buf.get(name, x.shape[1], x.shape[0]), x)

    def operand(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """An fp32 tile (P, dS) rounded to bf16 (to nearest even) in workspace ``name``."""
        return self.buf.get(name, *x.shape).copy_(x)

    def rounded_tile(self, name: str, rows: int, cols: int) -> torch.Tensor:
        """A bf16 workspace for the fused softmax passes to write their fp32 tile into, rounded, while its rows are
        in the caches: the tile's operand without :meth:`operand`'s extra sweep."""
        return self.buf.get(name, rows, cols)

    def grad_operand(self, name: str, dy: torch.Tensor, v: torch.Tensor, prob: torch.Tensor, delta: torch.Tensor,
                     unit_zero: bool) -> torch.Tensor | None:
        """The operand dS of a tile (workspace ``name``, bf16) formed in the dP GEMM's registers
        (:func:`.bf16_gemm.grad_gemm_`): ``P * (dy V^T - D)``, 0 where ``unit_zero`` and ``P == 1``; None where the
        head dim is longer than that GEMM takes."""
        if dy.shape[1] > GRAD_MAX_K:
            return None
        return grad_gemm_(self.buf.get(name, *prob.shape), dy, v, prob, delta, unit_zero)

    def backward_tiles(self, q: torch.Tensor, dy: torch.Tensor, m: torch.Tensor, neg_log2_l: torch.Tensor,
                       delta: torch.Tensor, dq: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       unit_zero: bool) -> BackwardTiles | None:
        """A job's tiles without explicit mask, pse, dropout or softcap, each in the products and passes the engine
        makes one by one, in their order, and all in one call (:class:`.bf16_tiles.BackwardTiles`, on the operands
        of a KV head's ``G`` query heads: ``q``/``dy``/``m``/``neg_log2_l``/``delta``/``dq`` ``[G, Sq, *]``, ``k``/``v``
        ``[Skv, *]``); None where the head dim is longer than the dS GEMM takes."""
        if dy.shape[-1] > GRAD_MAX_K:
            return None
        return BackwardTiles(q, dy, m, neg_log2_l, delta, dq, k, v, unit_zero, self.alpha, self.fp32, self.buf)

    def forward_tiles(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor,
                      l: torch.Tensor) -> ForwardTiles:
        """A forward job's column blocks without explicit mask, pse, dropout or softcap, each in the products and
        passes the engine makes one by one, in their order, and all in one call (:class:`.bf16_tiles.ForwardTiles`,
        on a query head's ``q`` ``[Sq, d]`` and statistics ``m``/``l`` ``[Sq, 1]`` and its KV head's ``k``/``v``)."""
        return ForwardTiles(q, k, v, m, l, self.alpha, self.fp32, self.buf)

    def nt(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return gemm_(out, x, w, b_nt=True)

    def nn(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return gemm_(out, x, w, b_nt=False)

    def add_nn_(self, acc: torch.Tensor, x: torch.Tensor, w: torch.Tensor, alpha: float = 1.0) -> None:
        gemm_(acc, x, w, b_nt=False, alpha=alpha, accumulate=True)

    def release(self) -> None:
        """The bf16 workspaces' :meth:`Buffers.release`."""
        self.buf.release()


class _Bf16Keys:
    """A KV head's bf16 keys (``[Skv, D]``) for the scores ``alpha * Q K^T``."""

    def __init__(self, k: torch.Tensor, alpha: float):
        self.k, self.alpha = k, alpha

    def scores(self, qs: torch.Tensor, c0: int, c1: int, out: torch.Tensor) -> torch.Tensor:
        return gemm_(out, qs, self.k[c0:c1], b_nt=True, alpha=self.alpha)
