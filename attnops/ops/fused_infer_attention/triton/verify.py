"""Why an FIA call cannot run on the Triton kernels (None when it can): the decode kernels (a few query rows per
batch; dense, paged ND and NZ caches) or, for the rest, the prefill kernel (every batch in one launch). Pure Python:
no Triton import beyond the availability check, so dispatch can ask on any machine; O(1) in the batch size and the
page count."""
from __future__ import annotations

import torch

from ...._core.triton.support import kernel_input_reason
from ..problem import FIAProblem

MAX_HEAD_DIM = 256
MAX_QUERY_ROWS = 16  # query rows of a batch: decode and short speculative / chunked steps
MAX_GROUP_ROWS = 128  # G x rows carried by one program


def kernel_route(p: FIAProblem, query: torch.Tensor, key, value, options: dict) -> tuple[str | None, str | None]:
    """``("decode" | "prefill", None)``: the Triton kernels that serve problem ``p`` (built from ``query``, ``key``,
    ``value`` and the call's ``options``, aclnn names), or ``(None, reason)`` when none can."""
    reason = kernel_input_reason(query, "queries")
    if reason is not None:
        return None, reason
    decode = decode_reason(p, query, key, value, options)
    if decode is None:
        return "decode", None
    prefill = prefill_reason(p)
    if prefill is None:
        return "prefill", None
    return None, f"{decode}; the prefill kernel cannot serve it either: {prefill}"


def unsupported_reason(p: FIAProblem, query: torch.Tensor, key, value, options: dict) -> str | None:
    """The reason no Triton kernel can serve problem ``p``, or None (:func:`kernel_route`)."""
    return kernel_route(p, query, key, value, options)[1]


def prefill_reason(p: FIAProblem) -> str | None:
    """Why the prefill kernel cannot run ``p`` (float queries: no int8 chain), or None."""
    if p.device_values:
        return (f"{', '.join(p.device_values)} given as device tensors are read by the decode kernels only (pass "
                "host lists for this call)")
    if max(p.d, p.dv) > MAX_HEAD_DIM:
        return f"head dims up to {MAX_HEAD_DIM} (got D={p.d}, Dv={p.dv})"
    return None


def decode_reason(p: FIAProblem, query: torch.Tensor, key, value, options: dict) -> str | None:
    """Why the decode kernels cannot serve ``p`` (queries of a kernel dtype), or None. O(1): no per-batch work."""
    if not isinstance(key, torch.Tensor) or not isinstance(value, torch.Tensor):
        return "a key/value tensor list is not implemented in the Triton decode kernels"
    if p.prefix_len or options.get("key_shared_prefix") is not None:
        return "a shared prefix (key_shared_prefix) is not implemented in the Triton decode kernels"
    if any(x.stride(-1) != 1 for x in (query, key, value)):
        return "query, key and value need a unit last stride"
    if p.key_quant is None and key.dtype != query.dtype:
        return f"key/value of dtype {key.dtype} need antiquant parameters"
    rows = p.q_rows
    if rows > MAX_QUERY_ROWS or rows * p.group > MAX_GROUP_ROWS:
        return (f"the Triton decode kernels take at most {MAX_QUERY_ROWS} query rows per batch and "
                f"{MAX_GROUP_ROWS} rows per KV head (got {rows} x group {p.group})")
    if max(p.d, p.dv) > MAX_HEAD_DIM:
        return f"head dims up to {MAX_HEAD_DIM} (got D={p.d}, Dv={p.dv})"
    return None
