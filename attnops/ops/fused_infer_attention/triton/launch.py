"""Host side of the Triton FIA decode kernels: the per-batch metadata, K/V addressing (dense tensors read in place,
paged caches in both layouts through the block table), antiquant parameter strides, the split of the KV columns,
allocation, the two launches (``split_kernel`` then ``merge_kernel``) and the final cast or int8 quantization of the
output rows.

Every batch's columns are cut into ``n_splits`` splits of ``split_len`` tokens (a multiple of 64): enough programs to
fill the GPU (two per SM), at least :data:`MIN_SPLIT_TOKENS` tokens each, at most :data:`MAX_SPLITS`. In Triton's
interpreter (CPU tensors) tiles are 16 tokens and splits 32, so tiny tests cover several splits.
"""
from __future__ import annotations

import torch

from ...._core.layouts import tokens_view
from ...._core.masks import INF
from ...._core.triton.launch import KernelFamily, Launch, cdiv, pow2
from ...._core.triton.support import interpreting
from ...flash_attention.triton import launch as fa_launch
from ..problem import FIAProblem
from ..quant import cast_round

MAX_SPLITS = 64
MIN_SPLIT_TOKENS = 256  # GPU: the least tokens per split worth a program
SPLIT_GRAIN = 64  # split lengths are multiples of every tile width
INTERPRET_TILE, INTERPRET_SPLIT = 16, 32
MIN_ROWS = 16  # tl.dot needs 16 rows: the G x Sq query rows are padded to at least this
KV_FLOAT, KV_INT8, KV_INT4 = 0, 1, 2  # kernels.KV_*


def _tile_configs(launch: Launch, named_args: dict, interpret: bool) -> list:
    """One configuration per launch: 16-token tiles in the interpreter; on the GPU the widest KV tile that compiles
    without spills on sm_80 and sm_90 with Triton 3.6 and 3.9 (``python -m attnops aot``): 16 tokens for int4
    (unpacking doubles the live tile) and for 64 or more query rows, 32 for fp32, else 64, with 8 warps for those and
    for head dims over 128."""
    import triton

    if launch.kernel == "merge_kernel":
        return [triton.Config({}, num_warps=4 if launch.kwargs["BLOCK_DV"] > 64 else 2, num_stages=1)]
    if interpret:
        return [triton.Config(dict(BLOCK_N=INTERPRET_TILE), num_warps=4, num_stages=1)]
    kw = launch.kwargs
    if kw["BLOCK_R"] >= 64:
        return [triton.Config(dict(BLOCK_N=16), num_warps=8, num_stages=1)]
    if KV_INT4 in (kw["K_QUANT"], kw["V_QUANT"]):
        return [triton.Config(dict(BLOCK_N=16), num_warps=8, num_stages=2)]
    if named_args["q_ptr"].dtype == torch.float32:
        return [triton.Config(dict(BLOCK_N=32), num_warps=8, num_stages=2)]
    wide = max(kw["BLOCK_D"], kw["BLOCK_DV"]) > 128
    return [triton.Config(dict(BLOCK_N=64), num_warps=8 if wide else 4, num_stages=2)]


KERNELS = KernelFamily("fused_infer_attention", ("attnops.ops.fused_infer_attention.triton.kernels",),
                       _tile_configs)


def _offset(view: torch.Tensor, base: torch.Tensor) -> int:
    """Element offset of ``view``'s first element from ``base``'s (same storage)."""
    return view.storage_offset() - base.storage_offset()


def paged_strides(cache: torch.Tensor, n2: int) -> tuple[int, int, int]:
    """(block, token, head) strides of a ``[blocknum, blocksize, N2*W]`` or ``[blocknum, N2, blocksize, W]`` cache."""
    if cache.dim() == 4:
        return cache.stride(0), cache.stride(2), cache.stride(1)
    return cache.stride(0), cache.stride(1), cache.shape[-1] // n2


def _dense_strides(p: FIAProblem, which: str) -> tuple[int, int]:
    """(token, head) strides of the dense K or V runs (all views of one tensor)."""
    for runs in p.kv:
        if runs:
            x = getattr(runs[0], which)
            return x.stride(2), x.stride(1)
    return 0, 0


def _batch_meta(p: FIAProblem, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                paged: bool) -> torch.Tensor:
    """The int64 ``[B, 9]`` per-batch metadata (columns ``kernels.META_FIELDS``)."""
    rows = []
    mask = p.mask
    for b, q in enumerate(p.queries):
        runs = p.kv[b]
        dense = bool(runs) and not paged
        rows.append([_offset(q, query) if q.numel() else 0, q.shape[0], p.seq.kv_lens[b],
                     _offset(runs[0].key, key) if dense else 0, _offset(runs[0].value, value) if dense else 0,
                     runs[0].pos if dense else 0, max(mask.lo[b], -INF), min(mask.hi[b], INF),
                     mask.prefix[b] if mask.prefix is not None else 0])
    return torch.tensor(rows, dtype=torch.int64).reshape(len(p.queries), 9).to(query.device)


def _param_strides(kind: str, t: torch.Tensor) -> list[int]:
    """(batch, head, position, block, offset, channel) strides of an antiquant parameter of ``kind``; broadcast
    sizes get stride 0."""
    head = t.stride(1) if t.shape[1] > 1 else 0
    if kind == "static":  # [1, N2|1, 1, D|1]
        return [0, head, 0, 0, 0, t.stride(3) if t.shape[3] > 1 else 0]
    if kind == "token":  # [B, N2|1, S]
        return [t.stride(0), head, t.stride(2), 0, 0, 0]
    return [0, head, 0, t.stride(0), t.stride(2), 0]  # page: [blocknum, N2|1, blocksize]


def _antiquant_args(p: FIAProblem, device: torch.device, dummy: torch.Tensor) -> tuple[list, dict]:
    """Scale/offset pointers of K and V and their ``[4, 6]`` strides table (rows: K scale, K offset, V scale,
    V offset), with the offset flags and whether each is per channel (``static``) rather than per column."""
    tensors, strides, flags = [], [], {}
    for name, quant in (("K", p.key_quant), ("V", p.value_quant)):
        for t in (None, None) if quant is None else (quant.scale, quant.offset):
            tensors.append(dummy if t is None else t.to(device, torch.float32))
            strides.append([0] * 6 if t is None else _param_strides(quant.kind, tensors[-1]))
        flags[f"{name}_OFFSET"] = quant is not None and quant.offset is not None
        flags[f"{name}_STATIC"] = quant is not None and quant.kind == "static"
    return [*tensors, torch.tensor(strides, dtype=torch.int64).to(device)], flags


def _storage(x: torch.Tensor, quantized: bool) -> int:
    if not quantized:
        return KV_FLOAT
    return KV_INT4 if x.dtype == torch.int32 else KV_INT8


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (an H100's 132 when there is none: ahead-of-time compilation)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _splits(max_kv: int, programs: int, device: torch.device, interpret: bool) -> tuple[int, int]:
    """``(split_len, n_splits)`` for the longest KV length ``max_kv`` and ``programs`` = B x N2."""
    if interpret:
        n, grain = cdiv(max_kv, INTERPRET_SPLIT), INTERPRET_TILE
    else:
        target = 2 * _sm_count(device)
        n, grain = min(cdiv(target, programs), cdiv(max_kv, MIN_SPLIT_TOKENS)), SPLIT_GRAIN
    n = min(max(n, 1), MAX_SPLITS)
    split_len = cdiv(cdiv(max(max_kv, 1), n), grain) * grain
    return split_len, cdiv(max_kv, split_len)


def decode_plan(p: FIAProblem, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                block_table: torch.Tensor | None, interpret: bool):
    """``((o fp32 [B*N1*Sq, Dv], lse fp32 [B*N1*Sq]), sq, launches)`` of a problem the verifier accepted; ``sq`` is
    the longest query of a batch (row ``(b*N1 + h)*sq + i``)."""
    device, batch, paged = query.device, len(p.queries), block_table is not None
    sq = max((q.shape[0] for q in p.queries), default=0)
    some_q = next((q for q in p.queries if q.numel()), p.queries[0] if p.queries else query)
    q_st, q_sh = (some_q.stride(0), some_q.stride(1)) if some_q.dim() == 3 else (0, 0)
    if paged:
        (k_sblk, k_st, k_sh), (v_sblk, v_st, v_sh) = paged_strides(key, p.n2), paged_strides(value, p.n2)
        bt, bt_sb, block_size = block_table.to(device), block_table.stride(0), key.shape[2 if key.dim() == 4 else 1]
    else:
        (k_st, k_sh), (v_st, v_sh) = _dense_strides(p, "key"), _dense_strides(p, "value")
        k_sblk = v_sblk = bt_sb = 0
        bt, block_size = torch.zeros(1, dtype=torch.int32, device=device), 1
    split_len, n_splits = _splits(max(p.seq.kv_lens, default=0), batch * p.n2, device, interpret)
    rows = batch * p.n1 * sq
    pm = torch.empty(rows * n_splits, dtype=torch.float32, device=device)
    pl = torch.empty_like(pm)
    po = torch.empty(rows * n_splits * p.dv, dtype=torch.float32, device=device)
    o = torch.empty(rows, p.dv, dtype=torch.float32, device=device)
    lse = torch.empty(rows, dtype=torch.float32, device=device)
    if rows == 0 or n_splits == 0:
        return (o.zero_(), lse.fill_(float("inf"))), sq, []
    dummy = torch.zeros(1, dtype=torch.uint8, device=device)
    pse, _ = fa_launch.pse_args(p, device, dummy)
    mask, mask_flags = fa_launch.mask_args(p, device, dummy)
    antiquant, offset_flags = _antiquant_args(p, device, torch.zeros(1, dtype=torch.float32, device=device))
    upcast = interpret or query.dtype == torch.float32
    split = Launch("split_kernel", (batch, p.n2, n_splits),
                   (query, key, value, _batch_meta(p, query, key, value, paged), bt, pm, pl, po, *pse[:4], *mask,
                    *antiquant, q_st, q_sh, k_st, k_sh, k_sblk, v_st, v_sh, v_sblk, bt_sb, block_size, split_len,
                    n_splits, p.scale, p.n1, p.group, sq, p.d, p.dv),
                   dict(BLOCK_R=pow2(p.group * sq, MIN_ROWS), BLOCK_D=pow2(p.d), BLOCK_DV=pow2(p.dv), PAGED=paged,
                        K_QUANT=_storage(key, p.key_quant is not None),
                        V_QUANT=_storage(value, p.value_quant is not None), **offset_flags,
                        HAS_PSE=p.pse is not None, HAS_BAND=_has_band(p), **mask_flags,
                        UPCAST=upcast, PRECISION="ieee" if upcast else "tf32"))
    merge = Launch("merge_kernel", (rows,), (pm, pl, po, o, lse, n_splits, p.dv),
                   dict(BLOCK_S=pow2(n_splits, 2), BLOCK_DV=pow2(p.dv)))
    return (o, lse), sq, [split, merge]


def _has_band(p: FIAProblem) -> bool:
    """Whether some batch has a band or prefix to apply (else the kernel skips the test)."""
    return p.mask.prefix is not None or any(lo > -INF or hi < INF for lo, hi in zip(p.mask.lo, p.mask.hi))


def _store(p: FIAProblem, o: torch.Tensor, lse: torch.Tensor, sq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The call's outputs from the kernels' rows: ``attention_out`` in ``p.out_shape`` (cast with CAST_ROUND, or
    quantized to int8 where a row attended something) and the fp32 lse in ``p.lse_shape`` (0 and +inf elsewhere)."""
    device = o.device
    out = torch.zeros(p.out_shape, dtype=p.out_dtype, device=device)
    lse_out = torch.full(p.lse_shape, float("inf"), dtype=torch.float32, device=device)
    pairs = [(b, i, p.row_starts[b] + i) for b, q in enumerate(p.queries) for i in range(q.shape[0])]
    if not pairs:
        return out, lse_out
    bi, qi, dest = (torch.tensor(x, dtype=torch.int64, device=device) for x in zip(*pairs))
    rows_o = o.view(len(p.queries), p.n1, sq, p.dv)[bi, :, qi]  # [R, N1, Dv]
    rows_lse = lse.view(len(p.queries), p.n1, sq)[bi, :, qi]  # [R, N1]
    if p.out_quant is not None:
        rows_o = torch.where(rows_lse.isfinite().unsqueeze(-1), p.out_quant.apply(rows_o), 0)
    else:
        rows_o = cast_round(rows_o, p.out_dtype)
    tokens = tokens_view(out, p.out_layout, p.n1)
    if p.out_layout == "TND":
        tokens[dest] = rows_o
        lse_out[dest, :, 0] = rows_lse
    else:
        tokens[bi, dest] = rows_o
        lse_out[bi, :, dest, 0] = rows_lse
    return out, lse_out


def forward(p: FIAProblem, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            block_table: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(attention_out, softmax_lse)`` of a decode problem on the kernels."""
    (o, lse), sq, launches = decode_plan(p, query, key, value, block_table, interpreting(query.device))
    KERNELS.run_all(launches, query.device)
    return _store(p, o, lse, sq)
