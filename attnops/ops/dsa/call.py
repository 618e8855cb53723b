"""A DSA call's lengths and block table on the GPU hot path: read on the host, or left to the kernels.

Lengths (``actual_seq_lengths_*``, lists arrive as CPU tensors) on the CPU are read and validated on the host into
the normal form (:class:`~.problem.Problem`), as is a CPU block table; a block table on a device is kept there,
unread. Lengths given as tensors on a device are not read either: their shapes and dtypes are checked here, the
Triton kernels read the values (clamping every length into the tensors and masking out the keys of a block id
outside the cache, so a bad value never makes an access outside them), and a call the kernels cannot serve reads
CPU copies of them on the reference path, where they are validated as host values are. Index values (block table,
``sparse_indices``) are validated where :func:`~attnops._core.indices.validation_enabled` says so
(:func:`~.validate.check_index_values`).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from ..._core.checks import check_tensor, require
from ..._core.devices import to_cpu
from .problem import INDEX_DTYPES, Problem, build_problem, check_operands


@dataclass(frozen=True)
class Call:
    """A validated DSA call's layouts and metadata as given: ``host`` is its normal form when the lengths are host
    values (None when a length lives on a device); ``device_values`` names the metadata left on a device."""

    layout_query: str
    layout_key: str
    sparse_mode: int
    q_lens: Tensor | None
    kv_lens: Tensor | None
    block_table: Tensor | None
    device_values: tuple[str, ...]
    host: Problem | None
    _build: Callable[..., Problem]

    def problem(self) -> Problem:
        """The normal form on the host (the reference path): CPU copies of device values read and validated now."""
        if not self.device_values:
            return self.host
        return self._build(*to_cpu((self.q_lens, self.kv_lens, self.block_table)))


def make_call(query: Tensor, key: Tensor, *, layout_query: str, layout_key: str, sparse_mode: int,
              actual_seq_lengths_query=None, actual_seq_lengths_key=None, block_table: Tensor | None = None,
              key_name: str = "key", key_lengths_name: str = "actual_seq_lengths_key") -> Call:
    """The :class:`Call` of ``query`` and the one-kv-head ``key`` (arguments as :func:`~.problem.build_problem`)."""
    build = functools.partial(_build, query, key, layout_query, layout_key, sparse_mode, key_name, key_lengths_name)
    names = {"actual_seq_lengths_query": actual_seq_lengths_query, key_lengths_name: actual_seq_lengths_key,
             "block_table": block_table}
    on_device = tuple(name for name, x in names.items() if isinstance(x, Tensor) and x.device.type != "cpu")
    lengths_on_device = bool(set(on_device) - {"block_table"})
    if lengths_on_device:
        check_operands(query, key, layout_query=layout_query, layout_key=layout_key, sparse_mode=sparse_mode,
                       key_name=key_name)
        _check_shapes(query, key, layout_query, layout_key, actual_seq_lengths_query, actual_seq_lengths_key,
                      block_table, key_name, key_lengths_name)
    host = None if lengths_on_device else build(actual_seq_lengths_query, actual_seq_lengths_key, block_table)
    return Call(layout_query, layout_key, sparse_mode, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
                on_device, host, build)


def _build(query, key, layout_query, layout_key, sparse_mode, key_name, key_lengths_name, q_lens, kv_lens, table):
    return build_problem(query, key, layout_query=layout_query, layout_key=layout_key, sparse_mode=sparse_mode,
                         actual_seq_lengths_query=q_lens, actual_seq_lengths_key=kv_lens, block_table=table,
                         key_name=key_name, key_lengths_name=key_lengths_name)


def _lengths(name: str, x, query: Tensor, *, required: bool, counts: tuple[int, ...], what: str) -> None:
    """A lengths tensor's shape, dtype and device (its values are the kernels' to read)."""
    if x is None:
        require(not required, name, f"lengths ({what}, required with this layout)", None)
        return
    check_tensor(name, x, ndim=1, dtypes=INDEX_DTYPES)
    require(x.device == query.device, name, f"a tensor on {query.device} (the device of query)", x)
    require(x.numel() in counts, name, f"{' or '.join(map(str, counts))} entries ({what})", x)


def _check_shapes(query: Tensor, key: Tensor, layout_query: str, layout_key: str, q_lens, kv_lens, block_table,
                  key_name: str, key_lengths_name: str) -> None:
    """What the host checks of a call whose lengths live on a device: shapes, dtypes and devices, no values."""
    if layout_query == "TND":
        require(q_lens is not None and q_lens.numel() >= 1, "actual_seq_lengths_query",
                "cumulative lengths (required with layout TND)", q_lens)
        _lengths("actual_seq_lengths_query", q_lens, query, required=True, counts=(q_lens.numel(),),
                 what="cumulative ends, one per batch")
        batch = q_lens.numel()
    else:
        batch = query.shape[0]
        _lengths("actual_seq_lengths_query", q_lens, query, required=False, counts=(1, batch),
                 what="per-batch lengths or one for every batch")
    if layout_key == "TND":
        _lengths(key_lengths_name, kv_lens, query, required=True, counts=(batch,),
                 what="cumulative ends, one per batch like the query's")
        return
    _lengths(key_lengths_name, kv_lens, query, required=layout_key == "PA_BSND", counts=(1, batch),
             what="per-batch lengths or one for every batch")
    if layout_key == "BSND":
        require(key.shape[0] == batch, key_name, f"batch B={batch} like query", key)
        return
    check_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES)
    require(block_table.shape[0] == batch, "block_table", f"[B={batch}, max_blocks]", block_table)
