"""PyTorch's ``F.scaled_dot_product_attention`` on CPU inside ``context_parallel()``: ring attention with attnops'
FlashAttention as the per-step op.

Inside a region PyTorch's SDPA wrapper turns SDPA's tensors into sequence-sharded DTensors (its region input hook,
``_ContextParallel.sdpa_input_fn``), and DTensor runs the SDPA kernels it meets through the region's table of custom
op handlers (``torch.distributed.tensor.experimental._context_parallel._attention.custom_ops``, merged into DTensor's
op dispatcher when a region is entered and taken out when it exits). PyTorch's table covers the CUDA kernels (flash,
memory-efficient, cuDNN) only; :func:`register` adds the CPU kernel ``aten._scaled_dot_product_flash_attention_for_cpu``
and its backward, served by PyTorch's ring templates (rotate method and head-tail load balancing as the region sets
them) with attnops as the per-step op. ``scale`` and ``enable_gqa`` work as SDPA takes them. Calls the CPU kernel
would not get (PyTorch sends ``dropout_p > 0`` and value head sizes unlike the query's to its math kernel, which
cannot run on sequence shards) and ``attn_mask`` tensors are refused with an attnops error naming the argument, by
a check :func:`register` puts in front of the region's input hook for CPU tensors.
"""
from __future__ import annotations

import functools
import math

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp_attention

from .._core.checks import Described, fail, require
from .torch_cp import ring_backward, ring_forward

aten = torch.ops.aten
CPU_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_REGION = "inside torch's context_parallel() (ring attention over the mesh)"


def _check_options(attn_mask, dropout_p: float) -> None:
    if attn_mask is not None:
        fail("attn_mask", f"None {_REGION}", attn_mask, "Use is_causal=True for causal attention")
    if dropout_p != 0.0:
        fail("dropout_p", f"0.0 {_REGION}", dropout_p)


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False) -> dict:
    """``F.scaled_dot_product_attention``'s arguments by name."""
    return locals()


def _checked(input_fn):
    """PyTorch's region input hook, preceded by the checks of CPU calls."""

    @functools.wraps(input_fn)
    def sdpa_input_fn(self, module, args, kwargs, mesh):
        a = _sdpa_arguments(*args, **kwargs)
        if a["query"].device.type == "cpu":
            _check_options(a["attn_mask"], a["dropout_p"])
            require(a["value"].shape[-1] == a["query"].shape[-1], "value",
                    f"the query's head size {a['query'].shape[-1]} {_REGION}", Described(f"head size "
                    f"{a['value'].shape[-1]}"), "PyTorch sends other head sizes to its math kernel, which cannot run "
                    "on sequence shards")
        return input_fn(self, module, args, kwargs, mesh)

    sdpa_input_fn.attnops_checked = True
    return sdpa_input_fn


def _local_arguments(op: torch._ops.OpOverload, args: tuple, kwargs: dict):
    """The region's mesh and the op's arguments by name, DTensors replaced by their local shards."""
    info = DTensor._op_dispatcher.unwrap_to_op_info(op, args, kwargs)
    bound = {a.name: a.default_value for a in op._schema.arguments if a.has_default_value()}
    bound.update(zip((a.name for a in op._schema.arguments), info.local_args))
    bound.update(info.local_kwargs)
    mesh = info.compute_mesh
    require(mesh.ndim == 1, "mesh", "a one-dimensional DeviceMesh for context_parallel()",
            Described(f"ndim={mesh.ndim}"))
    _check_options(bound["attn_mask"], bound["dropout_p"])
    return mesh, bound


def _scale(bound: dict) -> float:
    scale = bound["scale"]
    return 1.0 / math.sqrt(bound["query"].shape[-1]) if scale is None else float(scale)


def _spec(like: DTensor, shape: torch.Size, dtype: torch.dtype) -> DTensorSpec:
    """A contiguous, sequence-sharded global spec on ``like``'s mesh."""
    stride = torch.empty(shape, device="meta").stride()
    return DTensorSpec(like.device_mesh, like.placements, TensorMeta(shape, stride, dtype))


def _forward(op, args: tuple, kwargs: dict):
    mesh, a = _local_arguments(op, args, kwargs)
    with torch.no_grad():
        out, lse = ring_forward(mesh.get_group(), a["is_causal"], _scale(a), a["query"], a["key"], a["value"])
    query, value = args[0], args[2]
    out_shape = torch.Size((*query.shape[:-1], value.shape[-1]))
    return DTensor._op_dispatcher.wrap((out, lse), (_spec(query, out_shape, out.dtype),
                                                     _spec(query, query.shape[:-1], lse.dtype)))


def _backward(op, args: tuple, kwargs: dict):
    mesh, a = _local_arguments(op, args, kwargs)
    with torch.no_grad():
        grads = ring_backward(mesh.get_group(), a["is_causal"], _scale(a), a["grad_out"], a["query"], a["key"],
                              a["value"], a["out"], a["logsumexp"])
    return DTensor._op_dispatcher.wrap(tuple(grads), tuple(x._spec for x in args[1:4]))


def register() -> None:
    """Serve CPU SDPA inside torch ``context_parallel()`` regions (done when :mod:`attnops.distributed` is
    imported): the handlers join PyTorch's own region table, the checks its region input hook."""
    torch_cp_attention.custom_ops.update({CPU_FORWARD: _forward, CPU_BACKWARD: _backward})
    style = torch_cp_attention._ContextParallel
    if not getattr(style.sdpa_input_fn, "attnops_checked", False):
        style.sdpa_input_fn = _checked(style.sdpa_input_fn)
