"""The Ascend A2/A3 attention kernels' rounding, for ``precision="npu"`` (see ``docs/precision.md``).

The kernels compute in fp32 and round to the input dtype at fixed points: the probabilities ``P`` before the
``P V`` product, the backward's ``dS`` before the ``dQ``/``dK`` products, and the outputs. AscendC's
``CAST_ROUND`` rounds to nearest with ties away from zero (PyTorch's casts break ties to even); ``CAST_RINT`` is
ties to even. :class:`NpuRounding` is the policy the reference cores consult; ``None`` in their place means exact
(one round-to-nearest-even cast of the fp32 result, the default).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..._core.checks import check_choice

PRECISIONS = ("exact", "npu")
FA_KEY_BLOCK = 512  # keys per online-softmax step of FlashAttentionScore: s2 basic block 128 x BMM_SOFTMAX_RATIO 4
ROUNDED_DTYPES = (torch.float16, torch.bfloat16)  # fp32 inputs run fp32 end to end on the NPU: nothing to round
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16}


def cast_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (a float tensor) cast to fp16/bf16 ``dtype`` with ``CAST_ROUND``: round to nearest, ties away from
    zero. Differs from ``x.to(dtype)`` only where ``x`` lies exactly halfway between two ``dtype`` values and the
    even one is nearer zero."""
    y = x.to(dtype)
    bits = _BITS.get(dtype)
    if bits is None:
        return y
    back = y.to(x.dtype)
    away = (y.view(bits) + 1).view(dtype)  # the next value away from zero (sign-magnitude encoding)
    tie = (x - back) == (away.to(x.dtype) - x)  # exactly halfway, and y was the one nearer zero
    return torch.where(tie, away, y)


def cast_round_int8(x: torch.Tensor) -> torch.Tensor:
    """``x`` (integral-valued or not) to int8 with ``CAST_ROUND``, saturating to ``[-128, 127]`` (+-inf too); NaN
    gives 0, as the NPU's float-to-integer conversion."""
    return (x.abs() + 0.5).floor_().copysign_(x).nan_to_num_(0.0).clamp_(-128, 127).to(torch.int8)


MSD_SCALE, MSD_STEP = 127.0, 254.0  # IFA's antiqCoeff1 and antiquantPreExpandCoeff


def msd_planes(x: torch.Tensor, planes: int) -> torch.Tensor:
    """fp32 ``x`` (rows on the last axis) as IFA's MSD sees it against int8 KV: per row ``a = x * 127 / max|x|``,
    plane 0 ``= round(a)``, plane i ``= round((a - planes before) * 254^i)`` (every round CAST_ROUND to an integral
    fp32, then exact conversions to fp16 and int8), recombined
    as ``sum_i plane_i * 254^-i * max|x| / 127`` in fp32. Rows of zeros stay zero."""
    top = x.abs().amax(-1, keepdim=True)
    a = x * (MSD_SCALE / torch.where(top > 0, top, 1.0))
    total = torch.zeros_like(a)
    for i in range(planes):
        step = MSD_STEP ** i
        plane = cast_round_int8((a - total) * step).float()  # fp32 -> integral fp32 -> fp16 -> int8: one rounding
        total = total + plane / step
    return total * (top / MSD_SCALE)


def check_precision(precision) -> str:
    """``precision`` validated: ``"exact"`` or ``"npu"`` (ParamInvalidError naming it otherwise)."""
    return check_choice("precision", precision, PRECISIONS)


@dataclass(frozen=True)
class NpuRounding:
    """Where a kernel rounds to ``dtype`` (the input dtype, fp16 or bf16).

    ``key_block``: keys per online-softmax step (``P`` is rounded relative to the running max of the blocks seen
    so far); ``even_output``: the output cast is ``CAST_RINT`` (ties to even: FIA/IFA bf16 outputs) instead of
    ``CAST_ROUND``; ``half_softmax``: scores and softmax in fp16 (PFA ``inner_precise=1``); ``query_planes``: int8
    planes of the query (and of P) against an int8 KV cache (IFA's MSD, :func:`msd_planes`; 0: not that kernel).
    """

    dtype: torch.dtype
    key_block: int = FA_KEY_BLOCK
    even_output: bool = False
    half_softmax: bool = False
    query_planes: int = 0

    def grid(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` rounded to the ``dtype`` grid with ``CAST_ROUND`` and returned in ``x``'s dtype (what the cube
        reads: its products of ``dtype`` values are exact in fp32)."""
        out = torch.empty_like(x)
        return out if _bf16_grid(x, self.dtype, out) else cast_round(x, self.dtype).to(x.dtype)

    def grid_(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`grid` in place."""
        return x if _bf16_grid(x, self.dtype, x) else x.copy_(cast_round(x, self.dtype))

    def store(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Write the fp32 result ``src`` into ``dst`` with the output cast (``CAST_ROUND``, or ties to even)."""
        return dst.copy_(src if self.even_output else cast_round(src, dst.dtype))


def _bf16_grid(x: torch.Tensor, dtype: torch.dtype, out: torch.Tensor) -> bool:
    """:func:`cast_round` of fp32 ``x`` to bf16, as fp32, written to ``out`` (``x`` itself or a tensor like it) in two
    passes over the bits: half a bf16 ulp added to the magnitude, the low 16 bits dropped (ties away from zero,
    overflow to inf). False, with nothing written, unless ``dtype`` is bf16 and ``x`` fp32 and NaN-free (a NaN's
    bits would not stay a NaN's)."""
    if dtype != torch.bfloat16 or x.dtype != torch.float32 or not x.is_contiguous() or math.isnan(float(x.sum())):
        return False
    torch.add(x.view(torch.int32), 0x8000, out=out.view(torch.int32)).bitwise_and_(-0x10000)
    return True


def npu_rounding(precision: str, dtype: torch.dtype, **options) -> NpuRounding | None:
    """The policy of ``precision`` for inputs of ``dtype``: None for ``"exact"`` and for dtypes the kernels do not
    round (fp32 runs fp32 end to end; fp64 is not an NPU dtype), else an :class:`NpuRounding`."""
    if check_precision(precision) == "exact" or dtype not in ROUNDED_DTYPES:
        return None
    return NpuRounding(dtype, **options)


def rounded_softmax(s: torch.Tensor, rounding: NpuRounding) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P, l)`` of scores ``s`` (rows on the last axis, fp32): ``P = exp(s - rowmax)`` as the kernel multiplies it
    with V (CAST_ROUND to ``rounding.dtype``) and ``l`` the row sums of the unrounded values (keepdim): the
    kernel's output is ``(P V) / l``."""
    e = (s - s.amax(-1, keepdim=True)).exp()
    return rounding.grid(e), e.sum(-1, keepdim=True)


def cast_output(rounding: NpuRounding | None, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, through ``rounding``'s output cast when there is one."""
    return x.to(dtype) if rounding is None else rounding.store(torch.empty_like(x, dtype=dtype), x)


def store(rounding: NpuRounding | None, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)``, through ``rounding``'s output cast when there is one."""
    return dst.copy_(src) if rounding is None else rounding.store(dst, src)
