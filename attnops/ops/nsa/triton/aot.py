"""The NSA kernels in the shared AOT machinery (``attnops._core.triton``): the problems ``python -m attnops aot``
compiles, from the launchers' own plans, fp16/bf16/fp32 x head dims 128 and 192/128: selected attention forward and
backward (GQA group 16, select blocks of 64), compression forward and backward (blocks of 32, stride 16),
compressed attention (the FlashAttention forward with the NSA causal rule or an explicit mask, then the score and
top-k kernels) and
the paged decode kernels (compression into a cache included), and the decoding step's preparation (positions,
lookups and RoPE) at head dims 64 and 128."""
from __future__ import annotations

import torch

from ...._core.triton.registry import register_aot
from ...common.triton import autotune as fa_tiles
from ...common.triton import launch as fa_launch
from ..compress import build_compress_spec
from ..compress_attention import build_compress_attention_spec
from ..decode import CompressSelection
from ..paged_kv import PagedKV
from ..selected import build_selected_spec
from ..step import CompressedMasks
from . import infer_launch, launch, step_launch
from .family import KERNELS

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEAD_DIMS = ((128, 128), (192, 128))
SELECTED_HEAD_DIMS = ((64, 64), *HEAD_DIMS)  # selected attention: also D=64


def _selected(dtype: str, d: int, dv: int) -> list:
    """Forward and backward launches of a small causal problem (only the signature matters, not the sizes)."""
    gen = torch.Generator().manual_seed(0)
    t, n2, group, block, count = 256, 1, 16, 64, 2
    q = torch.randn(t, n2 * group, d, generator=gen).to(DTYPES[dtype])
    k = torch.randn(t, n2, d, generator=gen).to(q.dtype)
    v, dy = torch.randn(t, n2, dv, generator=gen).to(q.dtype), torch.randn(t, n2 * group, dv, generator=gen).to(q.dtype)
    topk = torch.stack([torch.randperm(t // block, generator=gen)[:count] for _ in range(t)]).to(torch.int32)
    topk = topk.reshape(t, n2, count)
    spec = build_selected_spec(q, k, v, topk, scale_value=d ** -0.5, head_num=n2 * group, select_block_size=block,
                               select_block_count=count, actual_seq_qlen=[t], actual_seq_kvlen=[t], grad=True)
    (out, smax, ssum), fwd = launch.selected_forward_plan(spec, q, k, v, topk, interpret=False)
    _, bwd, _ = launch.selected_backward_plan(spec, q, k, v, out, dy, smax, ssum, topk, interpret=False)
    return [KERNELS.aot_launch(item) for item in fwd + bwd]


def _compress(dtype: str, d: int) -> list:
    """Forward and backward launches of a two-sequence compression."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 4, d, generator=gen).to(DTYPES[dtype])
    w = torch.randn(32, 4, generator=gen).to(x.dtype)
    spec = build_compress_spec(x, w, compress_block_size=32, compress_stride=16, actual_seq_len=[90, 200])
    out, fwd = launch.compress_forward_plan(spec, x, w, interpret=False)
    _, bwd = launch.compress_backward_plan(spec, torch.randn(out.shape, generator=gen).to(x.dtype), x, w,
                                           interpret=False)
    return [KERNELS.aot_launch(item) for item in fwd + bwd]


def _compress_attention(dtype: str, d: int, dv: int, causal: bool) -> list:
    """The attention forward and score launches of a two-batch TND problem: with the NSA causal rule and the
    forced-block rule (the layer's call) or with explicit atten_mask and topk_mask tensors."""
    t, gen = DTYPES[dtype], torch.Generator().manual_seed(0)
    q = torch.randn(96, 16, d, generator=gen).to(t)
    k = torch.randn(20, 4, d, generator=gen).to(t)
    v = torch.randn(20, 4, dv, generator=gen).to(t)
    mask = None if causal else torch.rand(64, 12, generator=gen) < 0.3
    forced = None if causal else (torch.arange(5) == 0).expand(64, 5)  # a topk_mask tensor
    spec = build_compress_attention_spec(q, k, v, scale_value=d ** -0.5, head_num=16, compress_block_size=32,
                                         compress_stride=16, select_block_size=64, select_block_count=2,
                                         atten_mask=mask, topk_mask=forced, local_blocks=2 if causal else -1,
                                         actual_seq_qlen=[32, 96], actual_cmp_seq_kvlen=[8, 20],
                                         actual_sel_seq_kvlen=[2, 5], sparse_mode=0, causal=causal)
    (out, smax, ssum), fwd = fa_launch.forward_plan(spec.fa, q, k, v, interpret=False)
    _, scores = infer_launch.importance_plan(spec, q, k, smax, ssum, interpret=False)
    return [fa_tiles.KERNELS.aot_launch(x) for x in fwd] + [KERNELS.aot_launch(x) for x in scores]


def _decode(dtype: str, d: int, dv: int) -> list:
    """The selected (split over its slots and merged, and in one piece) and compressed decode launches of two
    requests over a paged cache (64 query / 4 KV heads)."""
    t, gen = DTYPES[dtype], torch.Generator().manual_seed(0)
    q = torch.randn(2, 64, d, generator=gen).to(t)
    k = torch.randn(8, 16, 4, d, generator=gen).to(t)
    v = torch.randn(8, 16, 4, dv, generator=gen).to(t)
    table = torch.arange(8, dtype=torch.int32).reshape(2, 4)
    kv = PagedKV(2, 64, 4, dv, (64, 50), d ** -0.5, table.shape[1] * k.shape[1])
    topk = torch.zeros(2, 4, 2, dtype=torch.int32)
    _, sel = infer_launch.selected_decode_plan(kv, 32, q, k, v, topk, table, interpret=False)  # split, merged
    _, whole = infer_launch.selected_decode_plan(kv, 32, q, k, v, topk[..., :1], table, interpret=False)
    _, cmp = infer_launch.compress_decode_plan(kv, CompressSelection(32, 16, 64, 3), q, k, v, table, interpret=False)
    cache = infer_launch.compress_cache_plan(k, torch.randn(32, 4, generator=gen).to(t), torch.arange(2), table,
                                             torch.empty(6, 4, d, dtype=t), torch.tensor([64, 50]), 32, 16)
    return [KERNELS.aot_launch(x) for x in sel + whole + cmp + cache]


def _decode_step(dtype: str, d: int) -> list:
    """The decoding-step preparation of two sequences (16 query heads, 1 KV head) over a 4096-position cache."""
    t, capacity, window = DTYPES[dtype], 4096, 512
    q, k = torch.zeros(2, 16, d, dtype=t), torch.zeros(2, 1, d, dtype=t)
    slots = torch.zeros(2, window - 1 + capacity, dtype=torch.int64)
    masks = CompressedMasks(torch.zeros(1, 256 + 64, dtype=torch.bool), 256, 64, 32, 16, 64, 2)
    _, launches = step_launch.decode_step_plan(torch.zeros(2, dtype=torch.int64), 1, slots, window - 1,
                                               torch.zeros(2, capacity, dtype=torch.int64),
                                               torch.zeros(capacity, 2, d, dtype=t), q, k, masks, interpret=False)
    return [KERNELS.aot_launch(x) for x in launches]


for _dtype in DTYPES:
    for _d in (64, 128):
        register_aot("nsa", f"decode-step-{_dtype}-d{_d}", lambda dtype=_dtype, d=_d: _decode_step(dtype, d))
    for _d, _dv in SELECTED_HEAD_DIMS:
        register_aot("nsa", f"selected-{_dtype}-d{_d}-dv{_dv}",
                     lambda dtype=_dtype, d=_d, dv=_dv: _selected(dtype, d, dv))
    for _d, _dv in HEAD_DIMS:
        register_aot("nsa", f"compress-attention-causal-{_dtype}-d{_d}-dv{_dv}",
                     lambda dtype=_dtype, d=_d, dv=_dv: _compress_attention(dtype, d, dv, True))
        register_aot("nsa", f"compress-attention-mask-{_dtype}-d{_d}-dv{_dv}",
                     lambda dtype=_dtype, d=_d, dv=_dv: _compress_attention(dtype, d, dv, False))
        register_aot("nsa", f"decode-{_dtype}-d{_d}-dv{_dv}", lambda dtype=_dtype, d=_d, dv=_dv: _decode(dtype, d, dv))
    for _d in sorted({d for d, _ in HEAD_DIMS}):
        register_aot("nsa", f"compress-{_dtype}-d{_d}", lambda dtype=_dtype, d=_d: _compress(dtype, d))
