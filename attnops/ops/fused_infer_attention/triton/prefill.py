"""Host side of the FIA prefill kernel (``prefill_kernels.py``): one launch over every batch (one per batch for a
key/value tensor list) that reads the query, the shared prefix and K/V where they lie (dense, or paged ND/NZ through
the block table), dequantizes int8/int4 K/V in the kernel and writes the final output and lse.

The per-batch metadata rows (the FlashAttention kernels' format: query and key starts, lengths, band) come from the
problem's host lists and go up through :func:`~attnops._core.staging.cached_upload`: a repeated batch composition
uploads nothing. Nothing here reads a device tensor's values. The output and lse are ``torch.empty`` when the kernel
writes every row (full query lengths), else zero / ``+inf`` filled for the rows outside the actual lengths.
"""
from __future__ import annotations

import torch

from ...._core.layouts import io_layouts, token_strides
from ...._core.staging import cached_upload
from ...._core.triton.launch import Launch, cdiv, placeholder, pow2, unit_last_stride
from ...._core.triton.support import interpreting
from ...common.triton import launch_args as fa_args
from ..inputs import LAYOUTS
from ..problem import FIAProblem
from .family import KERNELS, precision_flags
from .kv_args import antiquant_args, cache_block_size, cache_strides, dense_strides, nz_x, storage
from .out_args import output_args

GRID_FOLD = 65535  # CUDA's limit on grid axes 1 and 2: batch x heads beyond it fold onto axis 2
META_FIELDS = ("q_start", "kv_start", "q_len", "kv_len", "lo", "hi", "prefix", "drop_off", "pse_q_start",
               "pse_kv_start", "stat_base", "stat_head")  # common/triton/common.META_FIELDS


def _meta(p: FIAProblem, device: torch.device) -> torch.Tensor:
    """The int64 ``[B, 12]`` per-batch rows (``META_FIELDS``; band offsets are ``MaskSpec``'s, ``-INF``/``INF`` when
    unbounded), staged once per distinct content."""
    zeros = (0,) * len(p.seq.q_lens)
    columns = dict(q_start=p.row_starts, kv_start=p.kv_starts, q_len=p.seq.q_lens, kv_len=p.seq.kv_lens,
                   lo=p.mask.lo, hi=p.mask.hi, prefix=p.mask.prefix or zeros)
    key = ("fia-prefill-meta", *columns.values())
    return cached_upload(key, lambda: list(zip(*(columns.get(name, zeros) for name in META_FIELDS))), torch.int64,
                         device)


def _writes_every_row(p: FIAProblem) -> bool:
    """Whether the kernel writes every output row: the actual query lengths cover the query (TND: every token)."""
    if p.out_layout == "TND":
        return sum(p.seq.q_lens) == p.out_shape[0]
    rows = p.out_shape[2 if p.out_layout == "BNSD" else 1]
    return all(n == rows for n in p.seq.q_lens)


def _outputs(p: FIAProblem, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(attention_out, softmax_lse)``: empty when the kernel writes every row, else 0 and +inf outside them."""
    if _writes_every_row(p):
        return (torch.empty(p.out_shape, dtype=p.out_dtype, device=device),
                torch.empty(p.lse_shape, dtype=torch.float32, device=device))
    return (torch.zeros(p.out_shape, dtype=p.out_dtype, device=device),
            torch.full(p.lse_shape, float("inf"), dtype=torch.float32, device=device))


def _output_strides(p: FIAProblem, out: torch.Tensor, lse: torch.Tensor) -> tuple[int, ...]:
    """The (batch, token, head) strides of the output and of the lse ``[B, N1, Q_S]`` / ``[T, N1]`` (TND: batch
    stride 0)."""
    tnd = p.out_layout == "TND"
    lse_strides = (0, lse.stride(0), lse.stride(1)) if tnd else (lse.stride(0), lse.stride(2), lse.stride(1))
    return (*token_strides(out, p.out_layout, p.n1), *lse_strides)


def _kv_sources(p: FIAProblem, key, value, in_layout: str, block_table) -> list[tuple]:
    """``(key, value, key strides, value strides, first batch, batches)`` of each launch (``kv_args``' six strides):
    one for a tensor or a paged cache, one per batch for a key/value tensor list."""
    if block_table is not None:
        return [(key, value, cache_strides(key, p.n2), cache_strides(value, p.n2), 0, len(p.seq.q_lens))]
    if isinstance(key, torch.Tensor):
        return [(key, value, dense_strides(key, in_layout, p.n2), dense_strides(value, in_layout, p.n2), 0,
                 len(p.seq.q_lens))]
    sources = []
    for b, (k, v) in enumerate(zip(key, value)):  # batch b's tensor [1, S_b, N2, W] is addressed as batch 0
        ks, vs = ((0, *dense_strides(x, in_layout, p.n2)[1:]) for x in (k, v))
        sources.append((k, v, ks, vs, b, 1))
    return sources


def _prefix_args(p: FIAProblem, options: dict, in_layout: str, dummy: torch.Tensor) -> tuple[list, tuple]:
    """The shared prefix's key and value pointers and their (token, head, channel) strides."""
    if not p.prefix_len:
        return [dummy, dummy], (0,) * 6
    kp, vp = (options[name] for name in ("key_shared_prefix", "value_shared_prefix"))
    ks, vs = (dense_strides(x, in_layout, p.n2) for x in (kp, vp))
    return [kp, vp], (ks[1], ks[2], ks[5], vs[1], vs[2], vs[5])


def prefill_plan(p: FIAProblem, query: torch.Tensor, key, value, options: dict, interpret: bool):
    """``((attention_out, softmax_lse), launches)`` of a problem the verifier sent to the prefill kernel (``key`` /
    ``value``: tensors, paged caches or per-batch lists; ``options``: the call's, aclnn names)."""
    device = query.device
    out, lse = _outputs(p, device)
    max_q = max(p.seq.q_lens, default=0)
    if max_q == 0:
        return (out, lse), []
    in_layout = io_layouts("input_layout", options.get("input_layout", "BSH"), LAYOUTS)[0]
    dummy = placeholder(device)
    query = unit_last_stride(query)
    block_table = options.get("block_table")
    paged = block_table is not None
    bt = block_table if paged else dummy
    block_size, num_blocks = (cache_block_size(key), key.shape[0]) if paged else (1, 1)
    pse, pse_flags = fa_args.pse_args(p, device, dummy)
    mask, mask_flags = fa_args.mask_args(p, device, dummy)
    antiquant, antiquant_flags = antiquant_args(p, device, dummy)
    quant_out, quant_strides, out_flags = output_args(p, dummy)
    prefix, prefix_strides = _prefix_args(p, options, in_layout, dummy)
    meta = _meta(p, device)
    launches = []
    for k, v, k_strides, v_strides, b_first, batches in _kv_sources(p, key, value, in_layout, block_table):
        n_bh = batches * p.n1
        rows = max_q if batches > 1 else p.seq.q_lens[b_first]
        if rows == 0:
            continue
        flags = dict(BLOCK_D=pow2(p.d), BLOCK_DV=pow2(p.dv), PAGED=paged, NZ_X=nz_x(k),
                     K_QUANT=storage(k, p.key_quant is not None), V_QUANT=storage(v, p.value_quant is not None),
                     **antiquant_flags, HAS_PREFIX=p.prefix_len > 0, PACKED=in_layout == "TND",
                     PSE=pse_flags["PSE"], **mask_flags, **out_flags, **precision_flags(query.dtype, interpret))
        args = (query, k, v, *prefix, out, lse, meta, bt, *pse[:4], *mask, *antiquant, *quant_out,
                *token_strides(query, in_layout, p.n1), *k_strides, *v_strides, *prefix_strides,
                *_output_strides(p, out, lse), *quant_strides,
                block_table.stride(0) if paged else 0, block_size, num_blocks, p.prefix_len, p.scale, p.n1, p.group,
                p.d, p.dv, b_first, n_bh, GRID_FOLD)
        launches.append(Launch("prefill_kernel", (rows, min(n_bh, GRID_FOLD), cdiv(n_bh, GRID_FOLD)), args, flags,
                               "BLOCK_M"))
    return (out, lse), launches


def forward(p: FIAProblem, query: torch.Tensor, key, value, options: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(attention_out, softmax_lse)`` of problem ``p`` (float queries: no int8 chain) on the prefill kernel."""
    (out, lse), launches = prefill_plan(p, query, key, value, options, interpreting(query.device))
    KERNELS.run_all(launches, query.device)
    return out, lse
