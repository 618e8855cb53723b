"""Host side of the NSA selected-attention and compression kernels: per-token/per-row metadata, the inverted top-k
lists of the deterministic dK/dV, grids and outputs. Every launcher builds a plan ``(outputs, [Launch, ...])`` (also
compiled by ``python -m attnops aot``) and runs it on the NSA kernel family (``family.py``, which also sizes the
tiles the grids depend on).

Tensors are read in place through strides (a unit last stride, copied only when missing). The metadata is built
with torch ops on the tensors' device (no Python loop over tokens).
"""
from __future__ import annotations

from itertools import accumulate

import torch

from ...._core.softmax_stats import FLT_LOWEST, FLT_MAX, STAT_LANES
from ...._core.triton.launch import Launch, cdiv, pow2, unit_last_stride
from ...._core.triton.support import interpreting
from ..compress import CompressSpec
from ..selected import SelectedSpec
from .family import KERNELS, key_tile, precision_flags, row_tile


def _ints(values, device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def _firsts(counts: list[int], device) -> torch.Tensor:
    """Exclusive prefix sums of ``counts`` (computed on the host: a handful of per-batch values)."""
    return _ints(list(accumulate(counts, initial=0))[:-1], device)


# ------------------------------------------------------------------------------------------- selected attention
def _tokens(spec: SelectedSpec, device) -> torch.Tensor:
    """int64 ``[T, 2]`` of the tokens that belong to a batch: the batch's first KV token, the token's local row."""
    seq = spec.seq
    lens = _ints(seq.q_lens, device)
    n = sum(seq.q_lens)
    kv_start = torch.repeat_interleave(_ints(seq.kv_starts, device), lens, output_size=n)
    row = torch.arange(n, device=device) - torch.repeat_interleave(_ints(seq.q_starts, device), lens, output_size=n)
    return torch.stack([kv_start, row], 1).contiguous()


def _selected_common(spec: SelectedSpec, query: torch.Tensor, interpret: bool) -> dict:
    return dict(CAUSAL=spec.causal, BLOCK_G=pow2(spec.group), BLOCK_D=pow2(spec.d), BLOCK_DV=pow2(spec.dv),
                **precision_flags(query.dtype, interpret))


def _scalars(spec: SelectedSpec) -> tuple:
    return spec.scale, spec.n1, spec.group, spec.d, spec.dv, spec.block_size


def selected_forward_plan(spec: SelectedSpec, query, key, value, topk, interpret: bool):
    """``((attention_out, softmax_max, softmax_sum), launches)``; tokens outside every batch keep out 0 and the
    invalid-row statistics."""
    device = query.device
    out = torch.zeros((spec.total_q, spec.n1, spec.dv), dtype=query.dtype, device=device)
    smax = torch.full((spec.total_q, spec.n1, STAT_LANES), FLT_LOWEST, dtype=torch.float32, device=device)
    ssum = torch.full((spec.total_q, spec.n1, STAT_LANES), FLT_MAX, dtype=torch.float32, device=device)
    tokens = _tokens(spec, device)
    if tokens.shape[0] == 0:
        return (out, smax, ssum), []
    q, k, v, topk = (unit_last_stride(x) for x in (query, key, value, topk))
    launch = Launch("selected_fwd_kernel", (tokens.shape[0], spec.n2),
                    (q, k, v, topk, out, smax, ssum, tokens, *q.stride()[:2], *k.stride()[:2], *v.stride()[:2],
                     *topk.stride()[:2], *out.stride()[:2], *_scalars(spec), spec.block_count),
                    _selected_common(spec, query, interpret))
    return (out, smax, ssum), [launch]


def _inverted_lists(spec: SelectedSpec, topk: torch.Tensor, tokens: int, device):
    """The selected blocks and, per (KV head, block), the tokens that selected it.

    Returns ``blocks`` int64 ``[NB, 2]`` (first KV token, first local position) of every block of the batches with
    queries, ``list_start`` ``[N2*NB + 1]`` and ``pair_token``: list ``h*NB + j`` is
    ``pair_token[list_start[h*NB + j]:list_start[h*NB + j + 1]]``, in (token, slot) order (a stable sort), a token
    once per slot that selected the block (duplicates accumulate). Deterministic ops only (no ``bincount``), so
    ``torch.use_deterministic_algorithms(True)`` accepts them on CUDA."""
    seq, bs = spec.seq, spec.block_size
    per_batch = [seq.kv_lens[b] // bs if seq.q_lens[b] else 0 for b in range(seq.batch)]
    n_blocks = sum(per_batch)
    counts = _ints(per_batch, device)
    base = _firsts(per_batch, device)  # first global block of each batch
    local = torch.arange(n_blocks, device=device) - torch.repeat_interleave(base, counts, output_size=n_blocks)
    first = torch.repeat_interleave(_ints(seq.kv_starts, device), counts, output_size=n_blocks) + local * bs
    blocks = torch.stack([first, local * bs], 1).contiguous()
    token_base = torch.repeat_interleave(base, _ints(seq.q_lens, device), output_size=tokens)
    heads = torch.arange(spec.n2, device=device) * n_blocks
    keys = (topk[:tokens].long() + token_base[:, None, None] + heads[None, :, None]).reshape(-1)
    sorted_keys, order = torch.sort(keys, stable=True)
    pair_token = order // (spec.n2 * spec.block_count)
    list_start = torch.searchsorted(sorted_keys, torch.arange(spec.n2 * n_blocks + 1, device=device))
    return blocks, list_start, pair_token, n_blocks


def selected_backward_plan(spec: SelectedSpec, query, key, value, attention_out, grad, softmax_max, softmax_sum,
                           topk, interpret: bool):
    """``((dq, dk, dv), launches)``: ``D = rowsum(dO * O)`` and dQ per token, dK/dV per (selected block, KV head)
    over the inverted lists; keys no token selected get 0."""
    device = query.device
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=device) for t in (query, key, value))
    tokens = _tokens(spec, device)
    n_tok = tokens.shape[0]
    if n_tok == 0:
        return (dq, dk, dv), []
    q, k, v, o, do, topk = (unit_last_stride(x) for x in (query, key, value, attention_out, grad, topk))
    smax, ssum = softmax_max.float().contiguous(), softmax_sum.float().contiguous()
    flags = _selected_common(spec, query, interpret)
    delta = torch.empty((n_tok, spec.n1), dtype=torch.float32, device=device)
    delta_launch = Launch("selected_delta_kernel", (n_tok, spec.n2),
                          (o, do, delta, *o.stride()[:2], *do.stride()[:2], spec.n1, spec.group, spec.dv),
                          dict(BLOCK_G=flags["BLOCK_G"], BLOCK_DV=flags["BLOCK_DV"]))
    dq_launch = Launch("selected_dq_kernel", (n_tok, spec.n2),
                       (q, k, v, do, dq, delta, smax, ssum, topk, tokens, *q.stride()[:2], *k.stride()[:2],
                        *v.stride()[:2], *do.stride()[:2], *dq.stride()[:2], *topk.stride()[:2], *_scalars(spec),
                        spec.block_count), flags)
    blocks, list_start, pair_token, n_blocks = _inverted_lists(spec, topk, n_tok, device)
    if n_blocks == 0:
        return (dq, dk, dv), [delta_launch, dq_launch]
    tiles = cdiv(spec.block_size, key_tile(spec.block_size, query.dtype, interpret))
    dkdv_launch = Launch("selected_dkdv_kernel", (n_blocks * tiles, spec.n2),
                         (q, k, v, do, dk, dv, delta, smax, ssum, tokens, blocks, list_start, pair_token,
                          *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *do.stride()[:2], *dk.stride()[:2],
                          *dv.stride()[:2], spec.scale, spec.n1, spec.n2, spec.group, spec.d, spec.dv,
                          spec.block_size, n_blocks), flags)
    return (dq, dk, dv), [delta_launch, dq_launch, dkdv_launch]


def selected_forward(spec: SelectedSpec, query, key, value, topk):
    outputs, launches = selected_forward_plan(spec, query, key, value, topk, interpreting(query.device))
    KERNELS.run_all(launches, query.device)
    return outputs


def selected_backward(spec: SelectedSpec, query, key, value, attention_out, grad, softmax_max, softmax_sum, topk):
    outputs, launches = selected_backward_plan(spec, query, key, value, attention_out, grad, softmax_max,
                                               softmax_sum, topk, interpreting(query.device))
    KERNELS.run_all(launches, query.device)
    return outputs


# ------------------------------------------------------------------------------------------------- compression
def _row_starts(spec: CompressSpec, device) -> torch.Tensor:
    """int64 ``[C]``: the first token of every compressed row (batch-major, block order)."""
    per_batch = [spec.blocks(b) for b in range(len(spec.lengths))]
    counts = _ints(per_batch, device)
    rows = spec.total_blocks
    base = _firsts(per_batch, device)
    local = torch.arange(rows, device=device) - torch.repeat_interleave(base, counts, output_size=rows)
    return torch.repeat_interleave(_ints(spec.starts, device), counts, output_size=rows) + local * spec.stride


def _token_rows(spec: CompressSpec, total: int, device) -> torch.Tensor:
    """int64 ``[T, 3]`` per token: its batch's first compressed row, its offset in the batch, the batch's row
    count (0 for tokens after the last batch)."""
    per_batch = [spec.blocks(b) for b in range(len(spec.lengths))]
    counts = _ints(per_batch, device)
    lens = _ints(spec.lengths, device)
    covered = sum(spec.lengths)
    meta = torch.zeros((total, 3), dtype=torch.int64, device=device)
    per_token = lambda x: torch.repeat_interleave(x, lens, output_size=covered)  # noqa: E731
    meta[:covered, 0] = per_token(_firsts(per_batch, device))
    meta[:covered, 1] = torch.arange(covered, device=device) - per_token(_ints(spec.starts, device))
    meta[:covered, 2] = per_token(counts)
    return meta


def compress_forward_plan(spec: CompressSpec, input, weight, interpret: bool):
    """``(output [C, N, D], launches)``."""
    t, n, d = input.shape
    out = torch.empty((spec.total_blocks, n, d), dtype=input.dtype, device=input.device)
    if out.shape[0] == 0 or n == 0:
        return out, []
    x, w = unit_last_stride(input), weight
    launch = Launch("compress_fwd_kernel", (out.shape[0], n),
                    (x, w, out, _row_starts(spec, input.device), *x.stride()[:2], *w.stride(), *out.stride()[:2],
                     d, spec.block), dict(BLOCK_D=pow2(d)))
    return out, [launch]


def compress_backward_plan(spec: CompressSpec, output_grad, input, weight, interpret: bool):
    """``((input_grad, weight_grad, weight_grad_partials), launches)``: the partials ``[programs, l, N]`` (fp32)
    are summed in program order by :func:`compress_backward`."""
    t, n, d = input.shape
    device = input.device
    dx = torch.empty(input.shape, dtype=input.dtype, device=device)
    rows = spec.total_blocks
    programs = cdiv(rows, row_tile(interpret))
    parts = torch.zeros((programs, spec.block, n), dtype=torch.float32, device=device)
    if t == 0 or n == 0:
        return (dx, parts), []
    x, dy = unit_last_stride(input), unit_last_stride(output_grad)
    dx_launch = Launch("compress_dx_kernel", (t, n),
                       (dy, weight, dx, _token_rows(spec, t, device), *dy.stride()[:2], *weight.stride(),
                        *dx.stride()[:2], d, spec.block, spec.stride), dict(BLOCK_D=pow2(d)))
    if rows == 0:
        return (dx, parts), [dx_launch]
    dw_launch = Launch("compress_dw_kernel", (programs, n),
                       (x, dy, _row_starts(spec, device), parts, *x.stride()[:2], *dy.stride()[:2], rows, n, d,
                        spec.block), dict(BLOCK_D=pow2(d)))
    return (dx, parts), [dx_launch, dw_launch]


def compress_forward(spec: CompressSpec, input, weight):
    out, launches = compress_forward_plan(spec, input, weight, interpreting(input.device))
    KERNELS.run_all(launches, input.device)
    return out


def compress_backward(spec: CompressSpec, output_grad, input, weight):
    """``(input_grad, weight_grad)``; the weight gradient is the fixed-order sum of the programs' partials."""
    (dx, parts), launches = compress_backward_plan(spec, output_grad, input, weight, interpreting(input.device))
    KERNELS.run_all(launches, input.device)
    return dx, parts.sum(0).to(weight.dtype)
