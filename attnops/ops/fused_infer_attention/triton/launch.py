"""The launches of the Triton FIA decode kernels (FlashInfer's ``run``): from a :class:`~.decode_plan.DecodePlan`
and the call's query, caches, block table and KV lengths, two launches (``split_kernel`` then ``merge_kernel``,
which writes the outputs in their final layout and dtype). The host cost does not depend on the batch size or the
page order: O(1) checks of shapes, dtypes and devices, two allocations, two launches; nothing is read back.
"""
from __future__ import annotations

import math

import torch

from ...._core.checks import Described, check_tensor, fail, int_list, require
from ...._core.layouts import token_strides
from ...._core.triton.launch import Launch, placeholder
from .decode_plan import DecodePlan, lengths_tensor
from .family import KERNELS
from .kv_args import cache_strides, dense_strides


def _check_same(name: str, x, shape, dtype, device) -> None:
    """O(1): ``x`` is a tensor of the plan's shape, dtype and device, with a unit last stride."""
    if not isinstance(x, torch.Tensor) or x.shape != shape or x.dtype != dtype or x.device != device:
        fail(name, f"a tensor of shape {list(shape)}, dtype {dtype} on {device} (as planned)", x)
    if x.stride(-1) != 1:  # the message is formatted only on failure (a per-call path)
        fail(name, "a unit last stride", Described(f"strides {x.stride()}"))


def _lengths(plan: DecodePlan, lengths) -> tuple[torch.Tensor, int]:
    """The KV lengths tensor the kernels read and its stride (0: one length shared by every batch)."""
    if lengths is None:
        lengths = plan.lengths
    elif not isinstance(lengths, torch.Tensor) or (lengths.device.type == "cpu" and plan.device.type != "cpu"):
        values = int_list("actual_seq_lengths_kv", lengths)
        if len(values) not in (1, plan.batch):  # messages are formatted only on failure (a per-call path)
            fail("actual_seq_lengths_kv", f"1 or B={plan.batch} lengths", values)
        bad = next((b for b, n in enumerate(values) if not 0 <= n <= plan.capacity), None)
        if bad is not None:
            fail(f"actual_seq_lengths_kv[{bad}]", f"a length in [0, {plan.capacity}] (the planned capacity)",
                 values[bad])
        lengths = lengths_tensor(values, plan.device)
    else:
        check_tensor("actual_seq_lengths_kv", lengths, ndim=1, dtypes=(torch.int32, torch.int64))
        if lengths.device != plan.device:
            fail("actual_seq_lengths_kv", f"a tensor on {plan.device}", lengths)
        if lengths.numel() != 1 and lengths.numel() < plan.batch:
            fail("actual_seq_lengths_kv", f"1 or at least B={plan.batch} lengths", lengths)
    return lengths, (0 if lengths.numel() == 1 else lengths.stride(0))


def run(plan: DecodePlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        block_table: torch.Tensor | None = None, lengths=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(attention_out, softmax_lse)`` of one call on a plan: ``query``, ``key``, ``value`` and ``block_table`` of
    the planned shapes, dtypes and device; ``lengths`` the KV lengths (a device tensor read by the kernels, a host
    list, or None for the planned ones). Values are not checked on the host: the kernels clamp lengths to the
    capacity and block ids into the cache."""
    outputs, launches = run_launches(plan, query, key, value, block_table, lengths)
    KERNELS.run_all(launches, plan.device)
    return outputs


def run_launches(plan: DecodePlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 block_table: torch.Tensor | None = None, lengths=None):
    """``((attention_out, softmax_lse), [split, merge])``: :func:`run`'s allocated outputs and launches."""
    device = plan.device
    _check_same("query", query, plan.query_shape, plan.query_dtype, device)
    _check_same("key", key, plan.key_shape, plan.kv_dtype, device)
    _check_same("value", value, plan.value_shape, plan.kv_dtype, device)
    if plan.table_shape is not None:
        if not isinstance(block_table, torch.Tensor) or tuple(block_table.shape) != plan.table_shape or \
                block_table.dtype not in (torch.int32, torch.int64) or block_table.device != device:
            fail("block_table", f"an int32/int64 tensor of shape {list(plan.table_shape)} on {device} (as planned)",
                 block_table)
        table, table_stride = block_table, block_table.stride(0)
    else:
        require(block_table is None, "block_table", "None (the plan has a dense key/value, no paged cache)",
                block_table)
        table, table_stride = placeholder(device, torch.int32), 0
    lengths, lengths_stride = _lengths(plan, lengths)
    if plan.units == 0 or plan.rows == 0:
        return (torch.zeros(plan.out_shape, dtype=plan.out_dtype, device=device),
                torch.full(plan.lse_shape, math.inf, dtype=torch.float32, device=device)), []
    new = torch.zeros if plan.out_zeroed else torch.empty
    out = new(plan.out_shape, dtype=plan.out_dtype, device=device)
    lse = torch.full(plan.lse_shape, math.inf, device=device) if plan.out_zeroed else \
        torch.empty(plan.lse_shape, dtype=torch.float32, device=device)
    if plan.paged:
        k_st, v_st = cache_strides(key, plan.n2), cache_strides(value, plan.n2)
    else:
        k_st, v_st = dense_strides(key, plan.in_layout, plan.n2), dense_strides(value, plan.in_layout, plan.n2)
    split = Launch("split_kernel", (plan.units, plan.n2),
                   (query, key, value, table, lengths, *token_strides(query, plan.in_layout, plan.n1), *k_st, *v_st,
                    table_stride, lengths_stride, *plan.split_args), plan.split_consts)
    merge = Launch("merge_kernel", (plan.batch * plan.n1, plan.merge_rows),
                   (out, lse, lengths, lengths_stride, *plan.merge_args), plan.merge_consts)
    return (out, lse), [split, merge]

