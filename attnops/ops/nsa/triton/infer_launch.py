"""Host side of the NSA compressed-attention and decode kernels: plans (allocated outputs and launches), their
kernel family and the torch steps around them on the device (forced blocks, top-k).

Compressed attention is the FlashAttention forward kernel (output and statistics), then ``importance_kernel``
(block scores ``[T, N2, maxSel]`` from the final statistics, the ``[T, N1, CmpS]`` probabilities never stored),
then the forced blocks and a stable descending sort: ``torch.sort(stable=True)`` orders equal scores by index, the
reference's tie rule, and blocks past a batch's selection length sit at -inf after every real block.
"""
from __future__ import annotations

import torch

from ...._core.softmax_stats import FLT_MAX
from ...._core.triton.launch import KernelFamily, Launch, cdiv, pow2
from ...._core.triton.support import interpreting
from ...flash_attention.triton import launch as fa_launch
from ..compress_attention import CompressAttentionSpec

INTERPRET_BLOCK = 16
SCORE_BLOCK_K = 16  # selection blocks per score program (the grid's third extent counts such tiles)


def _tile_configs(launch: Launch, named_args: dict, interpret: bool) -> list:
    """One fixed configuration per kernel (16 x 16 tiles in the interpreter)."""
    import triton

    if interpret:
        return [triton.Config(dict(BLOCK_M=INTERPRET_BLOCK, BLOCK_N=INTERPRET_BLOCK, BLOCK_K=SCORE_BLOCK_K))]
    wide = launch.kwargs["BLOCK_D"] > 128 or named_args["q_ptr"].element_size() == 4
    return [triton.Config(dict(BLOCK_M=64, BLOCK_N=32 if wide else 64, BLOCK_K=SCORE_BLOCK_K), num_warps=4,
                          num_stages=2)]


KERNELS = KernelFamily("nsa_infer", ("attnops.ops.nsa.triton.compress_attention",), _tile_configs)


def importance_plan(spec: CompressAttentionSpec, query, key, softmax_max, softmax_sum, interpret: bool):
    """``(scores [T, N2, maxSel] fp32, launches)``: the group-summed block scores (-inf past each batch's blocks)."""
    fa, device = spec.fa, query.device
    g, seq = fa.geom, fa.seq
    sel_max = max(spec.sel_lens, default=0)
    scores = torch.full((fa.total_q, g.n2, sel_max), float("-inf"), dtype=torch.float32, device=device)
    if fa.total_q == 0 or sel_max == 0:
        return scores, []
    qv, kv = fa_launch._token_view(query, fa, g.n1), fa_launch._token_view(key, fa, g.n2)
    dummy = torch.zeros(1, dtype=torch.uint8, device=device)
    mask, mask_flags = fa_launch._mask_args(fa, device, dummy)
    upcast = interpret or query.dtype == torch.float32
    sel = torch.tensor(spec.sel_lens, dtype=torch.int64, device=device)
    launch = Launch("importance_kernel", (seq.max_q, seq.batch * g.n2, cdiv(sel_max, SCORE_BLOCK_K)),
                    (qv, kv, softmax_max, softmax_sum, scores, fa_launch._meta(fa, device), sel,
                     qv.stride(0), qv.stride(1), kv.stride(0), kv.stride(1), fa_launch._stats_geometry(fa)[2],
                     scores.stride(0), scores.stride(1), *mask, fa.scale, g.n2, g.group, g.d, spec.m, spec.nn),
                    dict(BLOCK_D=pow2(g.d), UPCAST=upcast, PRECISION="ieee" if upcast else "tf32", **mask_flags),
                    "BLOCK_M")
    return scores, [launch]


def _row_geometry(spec: CompressAttentionSpec, device: torch.device):
    """Per query token: its row within its batch and its batch's selection length (0 for tokens past the
    batches)."""
    seq = spec.fa.seq
    lens = torch.tensor(list(seq.q_lens) + [spec.fa.total_q - sum(seq.q_lens)], dtype=torch.int64)
    starts = torch.tensor(list(seq.q_starts) + [sum(seq.q_lens)], dtype=torch.int64)
    local = torch.arange(spec.fa.total_q) - starts.repeat_interleave(lens)
    sel = torch.tensor(list(spec.sel_lens) + [0], dtype=torch.int64).repeat_interleave(lens)
    return local.to(device), sel.to(device)


def select_top_k(spec: CompressAttentionSpec, scores: torch.Tensor) -> torch.Tensor:
    """``topk_indices [T, N2, count]`` int32 from the ``[T, N2, maxSel]`` scores: ``topk_mask`` blocks forced,
    descending score, ties to the lower index; 0 on tokens past the batches (as the reference)."""
    local, sel = _row_geometry(spec, scores.device)
    if spec.topk_mask is not None:
        blocks = torch.arange(scores.shape[-1], device=scores.device)
        mask = spec.topk_mask.to(scores.device)[local.clamp(max=spec.topk_mask.shape[0] - 1), :scores.shape[-1]]
        forced = mask & (blocks < sel[:, None])
        scores = scores.masked_fill(forced.unsqueeze(1), FLT_MAX)
    scores = torch.nn.functional.pad(scores, (0, max(0, spec.select_count - scores.shape[-1])), value=float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :spec.select_count]
    return torch.where((sel > 0)[:, None, None], order, 0).to(torch.int32)


def compress_attention(spec: CompressAttentionSpec, query, key, value):
    """``(attention_out, topk_indices, softmax_max, softmax_sum)`` of ``nsa_compress_attention`` on the kernels."""
    out, smax, ssum = fa_launch.forward(spec.fa, query, key, value)
    scores, launches = importance_plan(spec, query, key, smax, ssum, interpreting(query.device))
    KERNELS.run_all(launches, query.device)
    return out, select_top_k(spec, scores), smax, ssum
