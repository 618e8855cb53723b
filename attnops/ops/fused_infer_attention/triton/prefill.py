"""Host side of the FIA prefill kernel (``prefill_kernels.py``): one launch over every batch (one per batch for a
key/value tensor list) that reads the query, the shared prefix and K/V where they lie (dense, or paged ND/NZ through
the block table), dequantizes int8/int4 K/V in the kernel and writes the final output and lse.

The per-batch metadata rows (the FlashAttention kernels' format: query and key starts, lengths, band) come from the
problem's host lists and go up through :func:`~attnops._core.staging.cached_upload`: a repeated batch composition
uploads nothing. Nothing here reads a device tensor's values. The output and lse are ``torch.empty`` when the kernel
writes every row (full query lengths), else zero / ``+inf`` filled for the rows outside the actual lengths.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ...._core.layouts import io_layouts, tokens_view
from ...._core.staging import cached_upload
from ...._core.triton.launch import KernelFamily, Launch, cdiv, pow2, unit_last_stride
from ...._core.triton.support import interpreting
from ...flash_attention.triton import launch as fa_launch
from ..problem import LAYOUTS, FIAProblem
from .kv_args import KV_INT4, antiquant_args, cache_addressing, cache_block_size, dense_addressing, storage

GRID_FOLD = 65535  # CUDA's limit on grid axes 1 and 2: batch x heads beyond it fold onto axis 2
INTERPRET_BLOCK = 16
MIN_BLOCK_M = 16  # tl.dot's least rows
OUT_CAST, OUT_CAST_ROUND, OUT_INT8 = 0, 1, 2  # rounding.OUT_*
META_FIELDS = ("q_start", "kv_start", "q_len", "kv_len", "lo", "hi", "prefix", "drop_off", "pse_q_start",
               "pse_kv_start", "stat_base", "stat_head")  # flash_attention/triton/common.META_FIELDS


def _tile_configs(launch: Launch, named_args: dict, interpret: bool) -> list:
    """One configuration per launch: 16 x 16 tiles in the interpreter; on the GPU the largest tiles that compile
    without spills on sm_80 and sm_90 (``python -m attnops aot --filter fused_infer``): 64 query rows x 64 keys for
    fp16/bf16, 64 x 32 with 8 warps when a pse, an explicit mask, antiquant, a paged cache or head dims over 128 add
    per-element work (64 x 16 for int4, whose unpacking doubles the live K/V tile); fp32 (FMA dots, twice the
    bytes): 32 x 32 with 8 warps, 32 x 16 with those features; 16 x 32 with 4 warps when no batch has more than 16
    query rows (calls the decode kernels refuse)."""
    import triton

    if interpret:
        return [triton.Config(dict(BLOCK_M=INTERPRET_BLOCK, BLOCK_N=INTERPRET_BLOCK), num_warps=4, num_stages=1)]
    if launch.grid[0] <= MIN_BLOCK_M:
        return [triton.Config(dict(BLOCK_M=MIN_BLOCK_M, BLOCK_N=32), num_warps=4, num_stages=2)]
    kw = launch.kwargs
    heavy = kw["PSE"] or kw["HAS_EXPLICIT"] or kw["K_QUANT"] or kw["V_QUANT"] or kw["PAGED"] or \
        max(kw["BLOCK_D"], kw["BLOCK_DV"]) > 128
    if named_args["q_ptr"].dtype == torch.float32:
        return [triton.Config(dict(BLOCK_M=32, BLOCK_N=16 if heavy else 32), num_warps=8, num_stages=1)]
    if KV_INT4 in (kw["K_QUANT"], kw["V_QUANT"]):
        return [triton.Config(dict(BLOCK_M=64, BLOCK_N=16), num_warps=8, num_stages=2)]
    if heavy:
        return [triton.Config(dict(BLOCK_M=64, BLOCK_N=32), num_warps=8, num_stages=2)]
    return [triton.Config(dict(BLOCK_M=64, BLOCK_N=64), num_warps=4, num_stages=3)]


KERNELS = KernelFamily("fused_infer_attention", ("attnops.ops.fused_infer_attention.triton.prefill_kernels",),
                       _tile_configs)


@functools.lru_cache(maxsize=None)
def _dummy(device: torch.device) -> torch.Tensor:
    """A one-element tensor standing for unused pointer arguments (never read nor written)."""
    return torch.zeros(1, dtype=torch.float32, device=device)


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


def _output_args(p: FIAProblem, out: torch.Tensor, lse: torch.Tensor, dummy: torch.Tensor
                 ) -> tuple[list, tuple, dict]:
    """The int8 output's scale and offset pointers; the strides of ``o`` (batch, token, head), ``lse`` (batch, token,
    head) and the scale/offset (head, channel); the output constexprs."""
    ov = tokens_view(out, p.out_layout, p.n1)
    if p.out_layout == "TND":
        o_strides, lse_strides = (0, ov.stride(0), ov.stride(1)), (0, lse.stride(0), lse.stride(1))
    else:
        o_strides, lse_strides = ov.stride()[:3], (lse.stride(0), lse.stride(2), lse.stride(1))
    q = p.out_quant
    if q is None:
        mode = OUT_CAST if p.out_dtype == torch.float32 else OUT_CAST_ROUND
        return [dummy, dummy], (*o_strides, *lse_strides, 0, 0), dict(OUT_MODE=mode, OUT_OFFSET=False)
    scale = q.scale
    quant_strides = (scale.stride(0) if scale.shape[0] > 1 else 0, scale.stride(1) if scale.shape[1] > 1 else 0)
    offset = dummy if q.offset is None else q.offset
    return [scale, offset], (*o_strides, *lse_strides, *quant_strides), dict(OUT_MODE=OUT_INT8,
                                                                               OUT_OFFSET=q.offset is not None)


def _kv_sources(p: FIAProblem, key, value, in_layout: str, block_table) -> list[tuple]:
    """``(key, value, key addressing, value addressing, first batch, batches)`` of each launch: one for a tensor
    or a paged cache, one per batch for a key/value tensor list."""
    if block_table is not None:
        return [(key, value, cache_addressing(key, p.n2), cache_addressing(value, p.n2), 0, len(p.seq.q_lens))]
    if isinstance(key, torch.Tensor):
        kv, vv = tokens_view(key, in_layout, p.n2), tokens_view(value, in_layout, p.n2)
        return [(key, value, dense_addressing(kv), dense_addressing(vv), 0, len(p.seq.q_lens))]
    sources = []
    for b, (k, v) in enumerate(zip(key, value)):  # batch b's tensor [1, S_b, N2, W] is addressed as batch 0
        ka, va = (dense_addressing(tokens_view(x, in_layout, p.n2)) for x in (k, v))
        sources.append((k, v, dataclasses.replace(ka, batch=0), dataclasses.replace(va, batch=0), b, 1))
    return sources


def _prefix_args(p: FIAProblem, options: dict, in_layout: str, dummy: torch.Tensor) -> tuple[list, tuple]:
    """The shared prefix's key and value pointers and their (token, head, channel) strides."""
    if not p.prefix_len:
        return [dummy, dummy], (0,) * 6
    kp, vp = (tokens_view(options[name], in_layout, p.n2)[0] for name in ("key_shared_prefix", "value_shared_prefix"))
    return [kp, vp], (*kp.stride(), *vp.stride())


def prefill_plan(p: FIAProblem, query: torch.Tensor, key, value, options: dict, interpret: bool):
    """``((attention_out, softmax_lse), launches)`` of a problem the verifier sent to the prefill kernel (``key`` /
    ``value``: tensors, paged caches or per-batch lists; ``options``: the call's, aclnn names)."""
    device = query.device
    out, lse = _outputs(p, device)
    max_q = max(p.seq.q_lens, default=0)
    if max_q == 0:
        return (out, lse), []
    in_layout = io_layouts("input_layout", options.get("input_layout", "BSH"), LAYOUTS)[0]
    dummy = _dummy(device)
    qv = tokens_view(unit_last_stride(query), in_layout, p.n1)
    q_strides = (0, qv.stride(0), qv.stride(1)) if in_layout == "TND" else qv.stride()[:3]
    block_table = options.get("block_table")
    paged = block_table is not None
    bt = block_table if paged else dummy
    block_size, num_blocks = (cache_block_size(key), key.shape[0]) if paged else (1, 1)
    pse, pse_flags = fa_launch.pse_args(p, device, dummy)
    mask, mask_flags = fa_launch.mask_args(p, device, dummy)
    antiquant, antiquant_flags = antiquant_args(p, device, dummy)
    quant_out, out_strides, out_flags = _output_args(p, out, lse, dummy)
    prefix, prefix_strides = _prefix_args(p, options, in_layout, dummy)
    meta = _meta(p, device)
    upcast = interpret or query.dtype == torch.float32
    launches = []
    for k, v, ka, va, b_first, batches in _kv_sources(p, key, value, in_layout, block_table):
        n_bh = batches * p.n1
        rows = max_q if batches > 1 else p.seq.q_lens[b_first]
        if rows == 0:
            continue
        flags = dict(BLOCK_D=pow2(p.d), BLOCK_DV=pow2(p.dv), PAGED=paged, NZ_X=ka.nz_x,
                     K_QUANT=storage(k, p.key_quant is not None), V_QUANT=storage(v, p.value_quant is not None),
                     **antiquant_flags, HAS_PREFIX=p.prefix_len > 0, PACKED=in_layout == "TND",
                     PSE=pse_flags["PSE"], **mask_flags, **out_flags, UPCAST=upcast,
                     PRECISION="ieee" if upcast else "tf32")
        args = (qv, k, v, *prefix, out, lse, meta, bt, *pse[:4], *mask, *antiquant, *quant_out, *q_strides,
                *ka.args(), *va.args(), *prefix_strides, *out_strides,
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
