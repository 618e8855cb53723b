"""FIA prefill on the FlashAttention Triton kernels: each batch with queries and keys becomes a one-batch
FlashAttention problem (its K/V gathered from the pages, the shared prefix first, dequantized to the query dtype as
the NPU's antiquant does) and runs the FlashAttention forward kernel; its statistics give the lse."""
from __future__ import annotations

import torch

from ...._core.layouts import tokens_view
from ...flash_attention.triton import launch as fa_launch
from .. import reference
from ..problem import FIAProblem


def forward(p: FIAProblem, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(attention_out, softmax_lse)`` of problem ``p`` (no int8 chain), batch by batch on the kernels."""
    out, lse = reference.new_outputs(p)
    out_tokens = tokens_view(out, p.out_layout, p.n1)
    for b in reference.active_batches(p):
        fa, q, k, v = reference.prefill_problem(p, b, query.dtype)
        o, smax, ssum = fa_launch.forward(fa, q, k, v)
        reference.store(p, b, o[0], reference.stats_lse(smax, ssum), out_tokens, lse)
    return out, lse
