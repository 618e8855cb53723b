"""Host side of the DeepSeek-V4 compressor's kernels: the plan ``(cmp_kv, [Launch, ...])`` (also compiled by
``python -m attnops aot``): two projection GEMMs into an fp32 scratch ``[T, 2 * coff * D]`` (``kv | gate``), the
pool (every output row, padding included, written by the kernel) and, with a state, the save of every new token's
``[kv | score]`` after the pool has read the old state. Nothing is read back from the device: lengths, start
positions and the block table (device tensors, or host ones uploaded by the caller) are read by the kernels, so the
plan never synchronises and a CUDA graph can capture it. Arguments are validated by the operator before they get
here; the state cache is written in place through its own strides (a view of a larger buffer works)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...._core.triton.launch import Launch, cdiv, pow2, unit_last_stride
from ...._core.triton.support import interpreting, precision_flags
from .compressor_family import KERNELS, project_tiles, save_tile


@dataclass(frozen=True)
class CompressorMetadata:
    """The call's metadata tensors on ``x``'s device (None where not given)."""
    cu_seqlens: torch.Tensor | None = None
    seqused: torch.Tensor | None = None
    start_pos: torch.Tensor | None = None
    state_block_table: torch.Tensor | None = None


@dataclass(frozen=True)
class Post:
    """vllm-ascend's RMSNorm + RoPE of the output rows (tensors None when absent)."""
    norm_weight: torch.Tensor | None = None
    rope_sin: torch.Tensor | None = None
    rope_cos: torch.Tensor | None = None
    rope_head_dim: int = 64
    norm_eps: float = 1e-6
    rotary_mode: int = 2


def compressor_plan(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, state_cache: torch.Tensor,
                    ape: torch.Tensor, meta: CompressorMetadata, post: Post, out_shape: tuple[int, ...], ratio: int,
                    coff: int, cache_mode: int, interpret: bool):
    """``(cmp_kv, launches)``: the compressed rows ``out_shape`` in ``x``'s dtype."""
    packed = x.dim() == 2
    hidden, width = x.shape[-1], wkv.shape[0]
    dim = width // coff
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    n_batch = meta.cu_seqlens.shape[0] - 1 if packed else x.shape[0]
    if out.numel() == 0:
        return out, []
    if n_batch == 0:  # no batch: every row is padding
        return out.zero_(), []
    flat = unit_last_stride(x.reshape(-1, hidden))
    wkv, wgate, ape = (unit_last_stride(t) for t in (wkv, wgate, ape))
    tokens = flat.shape[0]
    rows = torch.empty(tokens, 2 * width, dtype=torch.float32, device=x.device)
    block_t, block_c, _ = project_tiles(x.dtype, interpret)
    launches = [Launch("compressor_project_kernel", (cdiv(tokens, block_t), cdiv(width, block_c)),
                       (flat, w, rows, tokens, hidden, width, col0, flat.stride(0), w.stride(0), rows.stride(0)),
                       precision_flags(x.dtype, interpret)) for w, col0 in ((wkv, 0), (wgate, width))]
    spare = rows
    table = meta.state_block_table
    ring = cache_mode == 2
    cu, used, pos, bt = (spare if t is None else unit_last_stride(t)
                         for t in (meta.cu_seqlens, meta.seqused, meta.start_pos, table))
    state_args = (rows.stride(0), ape.stride(0), *state_cache.stride(), bt.stride(0) if table is not None and
                  not ring else 0, table.shape[-1] if table is not None else 0)
    seg_len = 0 if packed else x.shape[1]
    lengths = dict(PACKED=packed, SEQUSED=meta.seqused is not None, START_POS=meta.start_pos is not None, RING=ring)
    sin, cos, nw = (spare if t is None else unit_last_stride(t) for t in (post.rope_sin, post.rope_cos,
                                                                            post.norm_weight))
    out_strides = (0, out.stride(0)) if packed else (out.stride(0), out.stride(1))
    rope_strides = (0, 0) if post.rope_sin is None else ((0, sin.stride(0)) if packed else sin.stride()[:2])
    grid = (out_shape[0], 1) if packed else (out_shape[1], out_shape[0])
    launches.append(Launch(
        "compressor_pool_kernel", grid,
        (rows, ape, state_cache, bt, cu, used, pos, out, nw, sin, cos, *state_args, *out_strides, *rope_strides,
         seg_len, tokens, n_batch, ratio, coff, dim, state_cache.shape[1], state_cache.shape[0], post.rope_head_dim,
         float(post.norm_eps)),
        dict(**lengths, HAS_STATE=table is not None, NORM=post.norm_weight is not None,
             ROPE=post.rope_sin is not None, INTERLEAVED=post.rotary_mode == 2, BLOCK_D=pow2(dim))))
    if table is not None:
        save_grid = ((tokens, 1) if packed else (x.shape[1], x.shape[0])) + (cdiv(width, save_tile(interpret)),)
        launches.append(Launch(
            "compressor_save_kernel", save_grid,
            (rows, ape, state_cache, bt, cu, used, pos, *state_args, seg_len, tokens, n_batch, ratio, coff, width,
             state_cache.shape[1], state_cache.shape[0]), lengths))
    return out, launches


def compressor(x, wkv, wgate, state_cache, ape, meta: CompressorMetadata, post: Post, out_shape, ratio: int,
               coff: int, cache_mode: int):
    """Runs :func:`compressor_plan`; returns the compressed rows (``state_cache`` updated in place)."""
    out, launches = compressor_plan(x, wkv, wgate, state_cache, ape, meta, post, out_shape, ratio, coff, cache_mode,
                                    interpreting(x.device))
    KERNELS.run_all(launches, x.device)
    return out
