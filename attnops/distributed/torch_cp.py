"""attnops' FlashAttention inside PyTorch's ``context_parallel()``: ring attention over the region's device mesh.

``torch.distributed.tensor.experimental.context_parallel(mesh, buffers=...)`` shards the buffers (head-tail load
balanced for causal attention) and replaces ``F.scaled_dot_product_attention`` for the region. attnops'
FlashAttention entry points (:func:`attnops.flash_attention`, the torch_npu ``npu_fusion_attention`` family) see the
region (:mod:`attnops._core.context_parallel`) and hand their call here: PyTorch's own ring templates
(``_templated_ring_attention`` and its backward, which follow ``set_rotate_method("allgather" | "alltoall")`` and
the load-balance option) run over the mesh's group with attnops' operator as the per-step attention op.
Supported inside a region: dense layouts, full or causal attention (``causal=True``, or ``sparse_mode`` 2/3 with
the compressed mask), GQA, Dv < D, any ``scale``; anything else raises an attnops error naming the argument.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

from .._core import context_parallel
from .._core.checks import Described, fail, require
from .._core.softmax_stats import STAT_LANES
from ..ops.flash_attention import flash_attention, flash_attention_backward
from ..ops.flash_attention.op import _SCHEMA
from ..ops.common.problem import INT_MAX
from .ring import from_internal, to_internal
from .sharding import head_geometry

SEQ_DIM = 2  # BNSD, as PyTorch's ring templates assume

_DEFAULTS = dict(pse=None, drop_mask=None, keep_prob=1.0, pre_tokens=INT_MAX, next_tokens=INT_MAX, prefix=None,
                 actual_seq_qlen=None, actual_seq_kvlen=None, cu_seqlens_q=None, cu_seqlens_k=None, softcap=0.0,
                 q_start_idx=0, kv_start_idx=0)


def region_group():
    """The process group of the enclosing region's (one-dimensional) device mesh."""
    wrapper = F.scaled_dot_product_attention
    cells = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__ or ()))
    mesh = cells["device_mesh"].cell_contents
    require(mesh.ndim == 1, "mesh", "a one-dimensional DeviceMesh for context_parallel()", Described(f"ndim={mesh.ndim}"))
    return mesh.get_group()


def _options(inputs: tuple, names: tuple[str, ...]) -> dict:
    """The operator call's arguments by name, after checking that every unsupported one has its default."""
    kw = dict(zip(names, inputs))
    for name, default in _DEFAULTS.items():
        value = kw.get(name, default)
        same = value is None if default is None else (not isinstance(value, Tensor) and value == default)
        if not same:
            fail(name, f"{default!r} inside torch's context_parallel() (ring attention over the mesh)", value)
    mode, mask = kw["sparse_mode"], kw["atten_mask"]
    require((mode == 0 and mask is None) or (mode in (2, 3) and mask is not None), "sparse_mode",
            "0 without atten_mask (full) or 2/3 with the compressed causal mask inside context_parallel()", mode)
    kw["causal"] = mode in (2, 3)
    return kw


def _local_forward(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: float):
    """PyTorch's per-step attention op: ``(out, logsumexp [B, N, S])`` of one BNSD block."""
    res = flash_attention(q, k, v, causal=is_causal, scale=scale, return_stats=True)
    return res.out, res.softmax_max[..., 0] + res.softmax_sum[..., 0].log()


def _local_backward(*, query, key, value, out, logsumexp, is_causal, grad_out, scale):
    """PyTorch's per-step backward op: gradients of one block from the merged output and logsumexp."""
    smax = logsumexp.unsqueeze(-1).expand(*logsumexp.shape, STAT_LANES).contiguous()
    dq, dk, dv, _ = flash_attention_backward(grad_out, query, key, value, out, smax, torch.ones_like(smax),
                                             causal=is_causal, scale=scale)
    return dq, dk, dv


def ring_forward(group, causal: bool, scale: float, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """PyTorch's ring template over ``group`` with attnops as the per-step op: ``(out, logsumexp)`` of BNSD shards."""
    with context_parallel.suspended():
        out, lse = torch_cp._templated_ring_attention(group, SEQ_DIM, _local_forward, q, k, v, is_causal=causal,
                                                      scale=scale)[:2]
    return out.to(q.dtype), lse


def ring_backward(group, causal: bool, scale: float, dout, q, k, v, out, lse):
    """PyTorch's ring backward template with attnops' backward as the per-step op: ``(dq, dk, dv)``."""
    with context_parallel.suspended():
        return torch_cp._templated_ring_attention_backward(group, SEQ_DIM, _local_backward, dout.contiguous(),
                                                           "grad_out", q, k, v, out, lse, causal, scale=scale)[:3]


class _TorchRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal: bool, scale: float):
        out, lse = ring_forward(group, causal, scale, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        dq, dk, dv = ring_backward(ctx.group, ctx.causal, ctx.scale, dout, *ctx.saved_tensors)
        return dq, dk, dv, None, None, None


class TorchRegionRunner:
    """Serves :func:`attnops.ops.flash_attention.op.flash_attention` / ``flash_attention_backward`` calls inside a
    region (``inputs``: the operators' arguments in schema order)."""

    @staticmethod
    def _geometry(kw: dict):
        layout, n1, d, n2 = head_geometry(kw["query"], kw["key"], kw["layout"], kw["head_num"])
        require(layout != "TND", "layout", "a dense layout inside torch's context_parallel()", layout)
        scale = float(d ** -0.5 if kw["scale"] is None else kw["scale"])
        return layout, n1, n2, scale

    def forward(self, inputs: tuple):
        kw = _options(inputs, _SCHEMA)
        layout, n1, n2, scale = self._geometry(kw)
        q, k, v = (to_internal(kw[n], layout, h) for n, h in (("query", n1), ("key", n2), ("value", n2)))
        out, lse = _TorchRing.apply(q, k, v, region_group(), kw["causal"], scale)
        smax = lse.unsqueeze(-1).expand(*lse.shape, STAT_LANES).contiguous()
        return from_internal(out, layout), smax, torch.ones_like(smax)

    def backward(self, inputs: tuple):
        names = ("dy", "query", "key", "value", "attention_out", "softmax_max", "softmax_sum", *_SCHEMA[3:])
        kw = _options(inputs, names)
        layout, n1, n2, scale = self._geometry(kw)
        dy, q, out = (to_internal(kw[n], layout, n1) for n in ("dy", "query", "attention_out"))
        k, v = (to_internal(kw[n], layout, n2) for n in ("key", "value"))
        lse = kw["softmax_max"][..., 0] + kw["softmax_sum"][..., 0].log()
        grads = ring_backward(region_group(), kw["causal"], scale, dy, q, k, v, out, lse)
        return (*(from_internal(g, layout) for g in grads), None)


def register() -> None:
    """Serve calls inside torch ``context_parallel()`` regions (done when :mod:`attnops.distributed` is imported)."""
    context_parallel.register(TorchRegionRunner())
