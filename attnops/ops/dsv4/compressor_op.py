"""The DeepSeek-V4 compressor as a ``torch.library`` custom op (namespace ``attnops``) with its fake kernel. It
updates ``state_cache`` in place, as the NPU does; not differentiable (an inference operator). Lengths, start
positions and the state block table are host metadata, read once per call. There is no Triton kernel: off the CPU
the reference runs on CPU copies (with a ``PerformanceWarning``; the state is copied back), and ``gpu_dry_run`` says
so before reading anything."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..._core.checks import check_tensor
from ..._core.custom_ops import register_dry_run_meta
from ..._core.devices import on_cpu
from ..._core.dispatch import choose_backend
from .compressor_reference import compressor_forward
from .compressor_problem import compressor_problem, output_shape


@torch.library.custom_op("attnops::dsv4_compressor", mutates_args=("state_cache",))
def dsv4_compressor(x: Tensor, wkv: Tensor, wgate: Tensor, state_cache: Tensor, ape: Tensor,
                    norm_weight: Optional[Tensor], rope_sin: Optional[Tensor], rope_cos: Optional[Tensor],
                    state_block_table: Optional[Tensor], cu_seqlens: Optional[Tensor], seqused: Optional[Tensor],
                    start_pos: Optional[Tensor], cmp_ratio: int, coff: int, cache_mode: int, rope_head_dim: int,
                    norm_eps: float, rotary_mode: int) -> Tensor:
    choose_backend("auto", check_tensor("x", x).device)  # no kernel yet: said before host values are read
    problem = compressor_problem(x, wkv, wgate, state_cache, ape, norm_weight=norm_weight, rope_sin=rope_sin,
                                 rope_cos=rope_cos, state_block_table=state_block_table, cu_seqlens=cu_seqlens,
                                 seqused=seqused, start_pos=start_pos, cmp_ratio=cmp_ratio, coff=coff,
                                 cache_mode=cache_mode, rope_head_dim=rope_head_dim, norm_eps=norm_eps,
                                 rotary_mode=rotary_mode)
    state = state_cache.cpu()  # the cache itself on the CPU, else a copy that is written back
    out = on_cpu(compressor_forward, problem, x, wkv, wgate, state, ape, norm_weight, rope_sin, rope_cos,
                 rope_head_dim, norm_eps, rotary_mode)
    if state is not state_cache:
        state_cache.copy_(state)
    return out


@dsv4_compressor.register_fake
def _(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos, state_block_table, cu_seqlens, seqused,
      start_pos, cmp_ratio, coff, cache_mode, rope_head_dim, norm_eps, rotary_mode):
    return x.new_empty(output_shape(x, wkv, cu_seqlens, cmp_ratio, coff))


register_dry_run_meta(dsv4_compressor)
