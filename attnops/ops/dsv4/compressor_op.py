"""The DeepSeek-V4 compressor as a ``torch.library`` custom op (namespace ``attnops``) with its fake kernel. It
updates ``state_cache`` in place, as the NPU does; not differentiable (an inference operator). The backend
(:mod:`.compressor_backend`) runs the Triton kernels on CUDA (metadata read by the kernels) or the reference on CPU
copies (the state copied back)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..._core.checks import check_tensor
from ..._core.custom_ops import register_dry_run_meta
from .compressor_backend import compressor
from .compressor_problem import output_shape
from .triton.compressor_launch import Post


@torch.library.custom_op("attnops::dsv4_compressor", mutates_args=("state_cache",))
def dsv4_compressor(x: Tensor, wkv: Tensor, wgate: Tensor, state_cache: Tensor, ape: Tensor,
                    norm_weight: Optional[Tensor], rope_sin: Optional[Tensor], rope_cos: Optional[Tensor],
                    state_block_table: Optional[Tensor], cu_seqlens: Optional[Tensor], seqused: Optional[Tensor],
                    start_pos: Optional[Tensor], cmp_ratio: int, coff: int, cache_mode: int, rope_head_dim: int,
                    norm_eps: float, rotary_mode: int) -> Tensor:
    check_tensor("x", x)
    return compressor(x, wkv, wgate, state_cache, ape,
                      Post(norm_weight, rope_sin, rope_cos, rope_head_dim, norm_eps, rotary_mode),
                      dict(cu_seqlens=cu_seqlens, seqused=seqused, start_pos=start_pos,
                           state_block_table=state_block_table), cmp_ratio=cmp_ratio, coff=coff,
                      cache_mode=cache_mode)


@dsv4_compressor.register_fake
def _(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos, state_block_table, cu_seqlens, seqused,
      start_pos, cmp_ratio, coff, cache_mode, rope_head_dim, norm_eps, rotary_mode):
    return x.new_empty(output_shape(x, wkv, cu_seqlens, cmp_ratio, coff))


register_dry_run_meta(dsv4_compressor)
