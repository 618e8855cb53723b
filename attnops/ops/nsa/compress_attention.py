"""NSA compressed attention with top-k block selection (NsaCompressAttention).

Attention over the compressed keys/values is the FlashAttention forward (TND, ``atten_mask`` with sparse mode
0/1, per-batch blocked statistics); its backward is the FlashAttention backward, as on the NPU. The importance of
selection block ``k`` for query row ``i`` is ``sum_t times[t] * P[i, m*(k+1) - t]`` (``m = l'/d``, ``nn = l//d``,
``times[t] = min(t+1, nn, m+nn-1-t)``, out-of-range columns contribute 0), summed over the GQA group;
``topk_mask`` blocks are always selected; ties go to the lower block index (``cann_semantics.md`` §7.3).
``causal`` (an attnops extension, the NSA layer's mask) masks compressed key ``c`` for the query at position ``i`` of
its sequence until its block is complete, ``c*stride + block - 1 > i``: a rule (``masks.StridedCausal``) the kernels
compute, in place of a dense ``[maxSq, maxCmpSkv]`` atten_mask. ``local_blocks`` (an attnops extension, the NSA layer's
``topk_mask``) forces block 0 and the ``local_blocks`` selection blocks ending at the token's own block
(:func:`forced_blocks`), a rule in place of a dense ``[maxSq, maxSelSkv]`` topk_mask. ``position_offset`` (with
either rule) is the position of every sequence's first query row: row ``r`` is at position ``position_offset + r``
(a chunk of new tokens after that many cached ones).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..._core.checks import Described, caller_names, check_int, check_tensor, int_list, require
from ..._core.masks import MASK_DTYPES, StridedCausal
from ..common.npu_rounding import npu_rounding
from ..._core.softmax_stats import FLT_LOWEST, FLT_MAX
from ..._core.staging import device_constant
from ..._core.varlen import lengths_from_cumulative
from ..common import reference as fa_reference
from ..common.problem import FAProblem, build_problem
from .memo import memoized


@dataclass(frozen=True)
class CompressAttentionSpec:
    fa: FAProblem
    block: int
    stride: int
    select_block: int
    select_count: int
    sel_lens: tuple[int, ...]
    topk_mask: torch.Tensor | None
    local_blocks: int | None = None  # the forced-block rule (:func:`forced_blocks`) in place of a topk_mask
    position_offset: int = 0  # the position of each sequence's first query row (the rules' positions)
    plans: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # launchers' derived launches

    @property
    def m(self) -> int:
        return self.select_block // self.stride

    @property
    def nn(self) -> int:
        return self.block // self.stride


def forced_blocks(positions: torch.Tensor, n_sel: int, select_block: int, local_blocks: int) -> torch.Tensor:
    """``[len(positions), n_sel]`` topk_mask of the NSA layer: block 0 and the ``local_blocks`` blocks ending at the
    block of the token's position (``positions``: within its sequence)."""
    own = torch.div(positions, select_block, rounding_mode="trunc").unsqueeze(1)
    cols, first = _block_columns(n_sel, positions.device)
    return first | ((cols <= own) & (cols > own - local_blocks))


@device_constant(32)
def _block_columns(n_sel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cols, cols == 0)``, ``cols = arange(n_sel)`` as ``[1, n_sel]`` (made once per size; read only)."""
    cols = torch.arange(n_sel, device=device).unsqueeze(0)
    return cols, cols == 0


def check_block_sizes(compress_block_size, compress_stride, select_block_size, select_block_count
                      ) -> tuple[int, int, int, int]:
    """The compression and selection sizes NSA's compressed attention accepts: ``1 <= compress_stride <=
    compress_block_size <= select_block_size``, ``select_block_size`` a multiple of the stride, at least one selected
    block; returns them as ints."""
    block = check_int("compress_block_size", compress_block_size, lo=1)
    stride = check_int("compress_stride", compress_stride, lo=1, hi=block)
    select = check_int("select_block_size", select_block_size, lo=block)
    require(select % stride == 0, "select_block_size", f"a multiple of compress_stride={stride}", select)
    return block, stride, select, check_int("select_block_count", select_block_count, lo=1)


def build_compress_attention_spec(query, key, value, *, scale_value: float, head_num: int, compress_block_size: int,
                                  compress_stride: int, select_block_size: int, select_block_count: int,
                                  topk_mask=None, atten_mask=None, actual_seq_qlen=None, actual_cmp_seq_kvlen=None,
                                  actual_sel_seq_kvlen=None, sparse_mode: int = 1,
                                  causal: bool = False, local_blocks: int = -1, position_offset: int = 0,
                                  precision: str = "exact") -> CompressAttentionSpec:
    """Validate a compressed-attention call and build its FlashAttention problem (remembered per configuration,
    the masks by identity, :mod:`.memo`); ``precision="npu"``: the problem's NPU rounding (the attention output;
    the importance scores stay exact)."""
    rounding = npu_rounding(precision, query.dtype)
    spec = memoized(_build_compress_attention_spec, query, key, value, held=("topk_mask", "atten_mask"),
                    scale_value=scale_value, head_num=head_num, compress_block_size=compress_block_size,
                    compress_stride=compress_stride, select_block_size=select_block_size,
                    select_block_count=select_block_count, topk_mask=topk_mask, atten_mask=atten_mask,
                    actual_seq_qlen=actual_seq_qlen, actual_cmp_seq_kvlen=actual_cmp_seq_kvlen,
                    actual_sel_seq_kvlen=actual_sel_seq_kvlen, sparse_mode=sparse_mode, causal=causal,
                    local_blocks=local_blocks, position_offset=position_offset)
    return spec if rounding is None else dataclasses.replace(spec, fa=dataclasses.replace(spec.fa, rounding=rounding))


def compress_attention_problem(query, key, value, *, scale_value: float, head_num: int, compress_block_size: int,
                               compress_stride: int, atten_mask, actual_seq_qlen, actual_cmp_seq_kvlen,
                               sparse_mode: int, causal: bool, position_offset: int = 0,
                               precision: str = "exact") -> FAProblem:
    """The FlashAttention problem of compressed attention (TND, sparse mode 0/1), with the causal rule when
    ``causal`` (then no ``atten_mask``; query row ``r`` at position ``position_offset + r``) and the NPU rounding
    of ``precision``."""
    require(sparse_mode in (0, 1), "sparse_mode", "0 or 1", sparse_mode)
    require(not (causal and atten_mask is not None), "atten_mask", "None with causal=True (the mask is computed)",
            atten_mask)
    require(actual_seq_qlen is not None and actual_cmp_seq_kvlen is not None, "actual_seq_qlen",
            "cumulative actual_seq_qlen and actual_cmp_seq_kvlen", None)
    with caller_names(actual_seq_kvlen="actual_cmp_seq_kvlen"):
        fa = build_problem(query, key, value, head_num=head_num, layout="TND", scale=scale_value,
                           atten_mask=atten_mask, sparse_mode=sparse_mode, actual_seq_qlen=int_list(
                               "actual_seq_qlen", actual_seq_qlen),
                           actual_seq_kvlen=int_list("actual_cmp_seq_kvlen", actual_cmp_seq_kvlen))
    rounding = npu_rounding(precision, query.dtype)
    if rounding is not None:
        fa = dataclasses.replace(fa, rounding=rounding)
    if not causal:
        return fa
    offset = check_int("position_offset", position_offset, lo=0)
    strided = StridedCausal(compress_stride, compress_block_size - 1 - offset)
    return dataclasses.replace(fa, mask=dataclasses.replace(fa.mask, strided=strided))


def _build_compress_attention_spec(query, key, value, *, scale_value, head_num, compress_block_size, compress_stride,
                                   select_block_size, select_block_count, topk_mask, atten_mask, actual_seq_qlen,
                                   actual_cmp_seq_kvlen, actual_sel_seq_kvlen, sparse_mode, causal,
                                   local_blocks=-1, position_offset=0) -> CompressAttentionSpec:
    """``local_blocks`` -1: no forced-block rule (the operator's signature has no None for an int)."""
    l_, d_, ls, count = check_block_sizes(compress_block_size, compress_stride, select_block_size, select_block_count)
    offset = check_int("position_offset", position_offset, lo=0)
    require(offset == 0 or causal or local_blocks != -1, "position_offset",
            "0 without causal=True or local_blocks (only the rules use positions)", offset)
    require(actual_sel_seq_kvlen is not None, "actual_sel_seq_kvlen", "cumulative selection lengths", None)
    fa = compress_attention_problem(query, key, value, scale_value=scale_value, head_num=head_num,
                                    compress_block_size=l_, compress_stride=d_, atten_mask=atten_mask,
                                    actual_seq_qlen=actual_seq_qlen, actual_cmp_seq_kvlen=actual_cmp_seq_kvlen,
                                    sparse_mode=sparse_mode, causal=causal, position_offset=offset)
    sel = lengths_from_cumulative("actual_sel_seq_kvlen", actual_sel_seq_kvlen)
    require(len(sel) == fa.seq.batch, "actual_sel_seq_kvlen", f"{fa.seq.batch} cumulative lengths (one per batch)",
            actual_sel_seq_kvlen)
    m = ls // d_
    for b, (cmp_len, sel_len) in enumerate(zip(fa.seq.kv_lens, sel)):
        want = -(-cmp_len // m)
        require(sel_len == want, "actual_sel_seq_kvlen",
                f"ceil(CmpSkv / (select_block_size / compress_stride)) = {want} in batch {b}", sel_len)
        if fa.seq.q_lens[b] > 0:
            require(count <= sel_len, "select_block_count", f"at most the selection length {sel_len} of batch {b}",
                    count)
    if topk_mask is not None:
        check_tensor("topk_mask", topk_mask, ndim=2, dtypes=MASK_DTYPES)
        require(topk_mask.shape[0] >= fa.seq.max_q and topk_mask.shape[1] >= max(sel, default=0), "topk_mask",
                f"a [maxSq, maxSelSkv] = [>={fa.seq.max_q}, >={max(sel, default=0)}] mask", topk_mask)
        topk_mask = topk_mask if topk_mask.dtype == torch.bool else topk_mask != 0
    local = None if local_blocks == -1 else check_int("local_blocks", local_blocks, lo=0)
    require(local is None or topk_mask is None, "topk_mask", "None with local_blocks (the forced blocks are a rule)",
            Described("a mask"))
    return CompressAttentionSpec(fa, l_, d_, ls, count, tuple(sel), topk_mask, local, offset)


def _importance_weights(spec: CompressAttentionSpec, cmp_len: int, sel_len: int):
    """Column index ``[sel_len, m+nn-1]`` and weight ``times[t]`` (0 where out of range) of the score formula."""
    m, nn = spec.m, spec.nn
    taps = m + nn - 1
    t = torch.arange(taps)
    times = torch.minimum(torch.minimum(t + 1, torch.full_like(t, nn)), taps - t)
    cols = m * (torch.arange(sel_len).unsqueeze(1) + 1) - t  # [sel, taps]
    valid = (cols >= 0) & (cols < cmp_len)
    return cols.clamp(0, max(cmp_len - 1, 0)), times * valid


def importance_scores(spec: CompressAttentionSpec, query, key, softmax_max, softmax_sum) -> list[torch.Tensor]:
    """Per batch ``[Sq_b, N2, SelSkv_b]`` scores summed over the GQA group (fp32), forced blocks at FLT_MAX."""
    fa = spec.fa
    scores = []
    for b in range(fa.seq.batch):
        sq, cmp_len, sel_len = fa.seq.q_lens[b], fa.seq.kv_lens[b], spec.sel_lens[b]
        score = torch.zeros(sq, fa.geom.n2, sel_len)
        if sq and cmp_len:
            cols, weights = _importance_weights(spec, cmp_len, sel_len)
            for tile, prob in fa_reference.probability_tiles(fa, b, query, key, softmax_max, softmax_sum):
                full = prob.new_zeros(prob.shape[0], prob.shape[1], cmp_len)
                full[..., tile.c0:tile.c1] = prob
                s = (full[..., cols] * weights.to(prob.dtype)).sum(-1).sum(0)  # [r, sel], summed over G
                score[tile.r0:tile.r1, tile.n2] = s.float()
        forced = _forced(spec, sq, sel_len)
        if forced is not None:
            score = score.masked_fill(forced.unsqueeze(1), FLT_MAX)
        scores.append(score)
    return scores


def _forced(spec: CompressAttentionSpec, sq: int, sel_len: int) -> torch.Tensor | None:
    """The ``[sq, sel_len]`` forced blocks of a batch: its ``topk_mask`` slice or the rule's (None: none)."""
    if spec.local_blocks is not None:
        return forced_blocks(torch.arange(sq) + spec.position_offset, sel_len, spec.select_block, spec.local_blocks)
    return None if spec.topk_mask is None else spec.topk_mask[:sq, :sel_len]


def nan_ranked(score: torch.Tensor) -> torch.Tensor:
    """Block scores for the top-k: a NaN score (non-finite inputs) ranks below every real score and above the
    blocks a row may not choose (-inf), as FLT_LOWEST (the Triton top-k kernel does the same)."""
    return torch.where(score.isnan(), FLT_LOWEST, score)


def select_top_k(spec: CompressAttentionSpec, scores: list[torch.Tensor]) -> torch.Tensor:
    """``topk_indices [T_q, N2, select_block_count]`` int32: descending score (NaN: :func:`nan_ranked`), ties to
    the lower index."""
    fa = spec.fa
    out = torch.zeros(fa.total_q, fa.geom.n2, spec.select_count, dtype=torch.int32)
    for b, score in enumerate(scores):
        if score.shape[0] == 0:
            continue
        order = torch.sort(nan_ranked(score), dim=-1, descending=True, stable=True).indices[..., :spec.select_count]
        start = fa.seq.q_starts[b]
        out[start:start + score.shape[0]] = order.to(torch.int32)
    return out


def compress_attention_forward(spec: CompressAttentionSpec, query, key, value):
    """``(attention_out, topk_indices, softmax_max, softmax_sum)`` (statistics in the per-batch blocked layout)."""
    out, smax, ssum = fa_reference.forward(spec.fa, query, key, value)
    topk = select_top_k(spec, importance_scores(spec, query, key, smax, ssum))
    return out, topk, smax, ssum
