"""Paged-KV-cache layouts of the torch_npu cache ops, read from the shapes (as CANN picks its scenario from them).

* ND: ``[num_blocks, block_size, N, D]`` or ``[num_blocks, block_size, N*D]``; token slot ``s`` is row
  ``s % block_size`` of block ``s // block_size``;
* NZ: ``[num_blocks, N*D // x, block_size, x]`` or ``[num_blocks, N, D // x, block_size, x]`` with ``x`` the values
  in 32 bytes (16 fp16/bf16, 32 int8, 8 fp32): element ``h = n*D + d`` of the token at slot ``s`` lives at
  ``[s // block_size, h // x, s % block_size, h % x]``.

A cache whose shape fits one layout is read in it; a shape that fits both (block_size = N and D = x) is read in
the layout the caller prefers (``cache_mode``, or ND for ops without one).
"""
from __future__ import annotations

from torch import Tensor

from .._core.checks import fail, require

ND, NZ = "ND", "NZ"


def nz_width(cache: Tensor) -> int:
    """x of an NZ cache: the values in 32 bytes of its dtype."""
    return max(1, 32 // cache.element_size())


def _nd_view(cache: Tensor, heads: int, width: int) -> Tensor | None:
    if (cache.dim() == 4 and cache.shape[2:].numel() == width and cache.shape[2] == heads) or (
            cache.dim() == 3 and cache.shape[2] == width):
        return cache.view(cache.shape[0], cache.shape[1], width).unsqueeze(1)
    return None


def _nz_view(cache: Tensor, heads: int, width: int) -> Tensor | None:
    if cache.dim() not in (4, 5) or cache.shape[-1] != nz_width(cache):  # 5-D: any split of N*D/x into two dims
        return None
    view = cache if cache.dim() == 4 else cache.flatten(1, 2)
    return view if view.shape[1] * view.shape[3] == width else None


_VIEWS = {ND: _nd_view, NZ: _nz_view}
_FORMS = {ND: "ND [num_blocks, block_size, N, D] or [num_blocks, block_size, N*D]",
          NZ: "NZ [num_blocks, N*D/{x}, block_size, {x}] or [num_blocks, N, D/{x}, block_size, {x}] ({dtype})"}


def cache_view(cache: Tensor, name: str, tokens: Tensor, token_name: str, layouts: tuple[str, ...]) -> Tensor:
    """``cache`` as a 4-D ``[num_blocks, chunks, block_size, X]`` view (ND: ``chunks = 1``, ``X = N*D``) in which
    element ``h`` of the token at slot ``s`` is ``[s // block_size, h // X, s % block_size, h % X]``, for ``tokens``
    ``[T, N, D]``: the first of ``layouts`` its shape fits."""
    require(cache.dtype == tokens.dtype, name, f"dtype {tokens.dtype} (same as {token_name})", cache.dtype)
    require(cache.is_contiguous(), name, "a contiguous cache (read and written through views of its memory)", cache,
            "pass the cache tensor itself, not a permuted or strided view")
    width = tokens.shape[1:].numel()
    for layout in layouts:
        view = _VIEWS[layout](cache, tokens.shape[1], width)
        if view is not None:
            return view
    forms = " or ".join(_FORMS[layout].format(x=nz_width(cache), dtype=cache.dtype) for layout in layouts)
    fail(name, f"a paged cache holding the N*D={width} elements of a {token_name} token "
         f"(N={tokens.shape[1]}): {forms}", cache,
         None if NZ in layouts else "pass cache_mode='PA_NZ' for an NZ cache")
