"""NSA compression (NsaCompress / NsaCompressGrad): a learned weighted sum over sliding blocks of tokens.

For each batch with ``S_b >= l`` the block ``k`` (``0 <= k <= (S_b - l) // d``) starting at token ``k*d`` gives
``out[c, n, :] = sum_w input[start + k*d + w, n, :] * weight[w, n]``; shorter sequences give no rows and tail
tokens that do not fill a block are dropped (``cann_semantics.md`` §7.1-7.2). Computed in fp32 (fp64 for fp64).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._core.checks import check_int, check_tensor, fail, int_list, require
from ..._core.varlen import lengths_from_cumulative
from .memo import memoized

NSA_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class CompressSpec:
    """Validated compression geometry: per-batch token starts/lengths and block counts."""

    block: int
    stride: int
    starts: tuple[int, ...]
    lengths: tuple[int, ...]

    def blocks(self, b: int) -> int:
        n = self.lengths[b]
        return 0 if n < self.block else (n - self.block) // self.stride + 1

    @property
    def total_blocks(self) -> int:
        return sum(self.blocks(b) for b in range(len(self.lengths)))


def compress_block_count(length: int, block: int, stride: int) -> int:
    """Compressed rows produced by one sequence of ``length`` tokens."""
    return 0 if length < block else (length - block) // stride + 1


def build_compress_spec(input, weight, *, compress_block_size: int, compress_stride: int, actual_seq_len,
                        act_seq_len_type: int = 0, layout: str = "TND", seq_name: str = "actual_seq_len"
                        ) -> CompressSpec:
    """Validate a compression call (shapes, dtypes, lengths) and return its :class:`CompressSpec` (remembered per
    configuration, :mod:`.memo`).

    ``seq_name`` is the caller's name of the lengths argument (aclnn: ``act_seq_len``), used in messages.
    """
    return memoized(_build_compress_spec, input, weight, compress_block_size=compress_block_size,
                    compress_stride=compress_stride, actual_seq_len=actual_seq_len,
                    act_seq_len_type=act_seq_len_type, layout=layout, seq_name=seq_name)


def _build_compress_spec(input, weight, *, compress_block_size, compress_stride, actual_seq_len, act_seq_len_type,
                         layout, seq_name) -> CompressSpec:
    check_tensor("input", input, ndim=3, dtypes=NSA_DTYPES)
    check_tensor("weight", weight, ndim=2)
    if weight.dtype != input.dtype:
        fail("weight", f"dtype {input.dtype} (same as input)", weight)
    require(layout == "TND", "layout", "'TND'", layout)
    l_ = check_int("compress_block_size", compress_block_size, lo=1)
    d_ = check_int("compress_stride", compress_stride, lo=1, hi=l_)
    require(tuple(weight.shape) == (l_, input.shape[1]), "weight",
            f"shape [compress_block_size={l_}, N={input.shape[1]}] (broadcast over D)", weight)
    check_int("act_seq_len_type", act_seq_len_type, lo=0, hi=1)
    t = input.shape[0]
    if actual_seq_len is None:
        lengths = [t]
    elif act_seq_len_type == 0:
        lengths = lengths_from_cumulative(seq_name, actual_seq_len, t)
    else:
        lengths = int_list(seq_name, actual_seq_len)
        require(all(n >= 0 for n in lengths) and sum(lengths) <= t, seq_name,
                f"non-negative per-batch lengths summing to at most T={t} (act_seq_len_type=1)", lengths)
    starts, acc = [], 0
    for n in lengths:
        starts.append(acc)
        acc += n
    return CompressSpec(l_, d_, tuple(starts), tuple(lengths))


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grad_acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulator of reductions over many blocks (weight_grad): fp64 for fp32/fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def compress_forward(spec: CompressSpec, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[sum_b blocks_b, N, D]`` compressed rows, batch-major, block order."""
    acc = _acc(input.dtype)
    w = weight.to(acc)
    rows = []
    for b, start in enumerate(spec.starts):
        nb = spec.blocks(b)
        if nb == 0:
            continue
        span = (nb - 1) * spec.stride + spec.block
        windows = input[start:start + span].to(acc).unfold(0, spec.block, spec.stride)  # [nb, N, D, l]
        rows.append(torch.einsum("cndw,wn->cnd", windows, w))
    if not rows:
        return input.new_zeros((0, input.shape[1], input.shape[2]))
    return torch.cat(rows).to(input.dtype)


def compress_backward(spec: CompressSpec, output_grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_grad, weight_grad)``; overlapping blocks accumulate, uncovered tokens get 0 (deterministic)."""
    acc, wacc = _acc(input.dtype), _grad_acc(input.dtype)
    w = weight.to(acc)
    input_grad = torch.zeros(input.shape, dtype=acc)
    weight_grad = torch.zeros(weight.shape, dtype=wacc)
    row = 0
    for b, start in enumerate(spec.starts):
        nb = spec.blocks(b)
        if nb == 0:
            continue
        og = output_grad[row:row + nb].to(acc)  # [nb, N, D]
        row += nb
        span = (nb - 1) * spec.stride + spec.block
        windows = input[start:start + span].to(acc).unfold(0, spec.block, spec.stride)
        weight_grad += torch.einsum("cndw,cnd->wn", windows.to(wacc), og.to(wacc))
        grad_b = input_grad[start:start + span]
        for offset in range(spec.block):  # token start + k*d + offset receives og[k] * weight[offset]
            grad_b[offset:offset + (nb - 1) * spec.stride + 1:spec.stride] += og * w[offset].unsqueeze(-1)
    return input_grad.to(input.dtype), weight_grad.to(weight.dtype)


def check_output_grad(output_grad, spec: CompressSpec, input) -> None:
    check_tensor("output_grad", output_grad, dtypes=(input.dtype,))
    want = (spec.total_blocks, input.shape[1], input.shape[2])
    require(tuple(output_grad.shape) == want, "output_grad", f"shape {list(want)} (the compressed output's)",
            output_grad)
