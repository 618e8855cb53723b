"""``npu_scatter_nd_update(_)``: rows of a tensor replaced at N-d indices (sglang's and vllm-ascend's KV-cache writes
with ``indices = slots.view(-1, 1)``), and vllm-ascend's ``torch.ops._C_ascend.npu_scatter_nd_update_v2``."""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.checks import check_tensor, require
from ._common import with_overloads

_INDEX_DTYPES = (torch.int32, torch.int64)
_DATA_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8)  # caches, quantized too


def _checked_shapes(input: Tensor, indices: Tensor, updates: Tensor) -> None:
    """``updates`` = ``indices.shape[:-1] + input.shape[K:]`` for ``K = indices.shape[-1]``; dtypes and devices."""
    check_tensor("input", input, ndim=range(1, 9), dtypes=_DATA_DTYPES)
    check_tensor("indices", indices, dtypes=_INDEX_DTYPES, device=input.device)
    require(indices.dim() >= 2 and 1 <= indices.shape[-1] <= input.dim(), "indices",
            f"at least 2 dims with the last one (the index depth) in [1, input.dim()={input.dim()}]", indices)
    depth = indices.shape[-1]
    expected = (*indices.shape[:-1], *input.shape[depth:])
    check_tensor("updates", updates, shape=expected, dtypes=(input.dtype,), device=input.device)


def _validated_index(input: Tensor, indices: Tensor, updates: Tensor) -> tuple[Tensor, ...]:
    """:func:`_checked_shapes`, and the index values when ``indices`` is on the CPU; returns the per-dimension
    indices."""
    _checked_shapes(input, indices, updates)
    depth = indices.shape[-1]
    if indices.device.type == "cpu" and indices.numel():  # a device index is used unread (graph capture)
        bounds = torch.tensor(input.shape[:depth], dtype=indices.dtype)
        bad = ((indices < 0) | (indices >= bounds)).any(-1).nonzero()
        require(bad.numel() == 0, "indices", f"indices in [0, {list(input.shape[:depth])}) (the NPU does not "
                "support out-of-range or negative indices)",
                f"{indices[tuple(bad[0])].tolist()} at {bad[0].tolist()}" if bad.numel() else "")
    return tuple(indices[..., i].long() for i in range(depth))


def npu_scatter_nd_update_(input: Tensor, indices: Tensor, updates: Tensor) -> Tensor:
    """In place: ``input[indices[j]] = updates[j]`` for every index row ``j`` (``indices [..., K]`` int32/int64,
    ``updates [..., *input.shape[K:]]``, ``input``'s dtype); returns ``input``. Indices must lie in
    ``input.shape[:K]`` (checked on the CPU); with repeated indices one of the rows is kept."""
    index = _validated_index(input, indices, updates)
    return input.index_put_(index, updates)


def npu_scatter_nd_update(input: Tensor, indices: Tensor, updates: Tensor) -> Tensor:
    """:func:`npu_scatter_nd_update_` on a copy: returns the updated copy, ``input`` is unchanged."""
    index = _validated_index(input, indices, updates)
    return input.index_put(index, updates)


def npu_scatter_nd_update_v2(var: Tensor, indices: Tensor, update: Tensor) -> None:
    """vllm-ascend's ScatterNdUpdateV2, in place: ``var[indices[j]] = update[j]`` (``var`` may be a strided view,
    e.g. a flattened cache); index rows outside ``var.shape[:K]`` (the ``-1`` of padded slot mappings) are skipped,
    as the kernel only writes the indices inside the range it owns."""
    _checked_shapes(var, indices, update)
    depth = indices.shape[-1]
    bounds = torch.tensor(var.shape[:depth], dtype=torch.int64, device=indices.device)
    rows = indices.long().reshape(-1, depth)
    keep = ((rows >= 0) & (rows < bounds)).all(-1)
    rows = rows[keep]
    var.index_put_(tuple(rows[:, i] for i in range(depth)), update.reshape(-1, *var.shape[depth:])[keep])


C_ASCEND_SCATTER_OPS = {"npu_scatter_nd_update_v2": with_overloads(npu_scatter_nd_update_v2)}
