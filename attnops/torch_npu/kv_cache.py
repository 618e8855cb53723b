"""Paged KV-cache writes and reads with torch_npu's signatures: ``npu_scatter_pa_kv_cache``,
``npu_gather_pa_kv_cache`` (and their ``_functional`` forms) and ``_npu_reshape_and_cache``.

Plain tensor indexing, vectorised over tokens, on any device. Cache layouts (``cache_mode``):

* ``"Norm"`` (ND): ``[num_blocks, block_size, N, D]`` (or ``[num_blocks, block_size, N*D]``); token slot ``s`` is
  row ``s % block_size`` of block ``s // block_size``;
* ``"PA_NZ"`` (NZ): ``[num_blocks, N*D // x, block_size, x]`` or ``[num_blocks, N, D // x, block_size, x]``: element
  ``h = n*D + d`` of the token at slot ``s`` lives at ``[s // block_size, h // x, s % block_size, h % x]``.

A negative slot skips its token (as the NPU kernel and op-plugin's golden do).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.checks import check_choice, check_tensor, fail, require
from ._common import with_overloads

CACHE_MODES = ("Norm", "PA_NZ")


def _token_rows(cache: Tensor, name: str, tokens: Tensor, token_name: str, nz: bool) -> tuple[Tensor, int]:
    """``(view, block_size)``: ``view[block, :, offset, :]`` (NZ) or ``view[block * block_size + offset]`` (ND) is
    one token's ``N*D`` elements, for ``tokens`` ``[T, N, D]``."""
    width = tokens[0].numel() if tokens.shape[0] else tokens.shape[1:].numel()
    require(cache.dtype == tokens.dtype, name, f"dtype {tokens.dtype} (same as {token_name})", cache.dtype)
    if nz:
        require(cache.dim() in (4, 5), name, "a 4-D [num_blocks, N*D/x, block_size, x] or 5-D "
                "[num_blocks, N, D/x, block_size, x] NZ cache (cache_mode='PA_NZ')", cache)
        view = cache if cache.dim() == 4 else cache.flatten(1, 2)
        require(view.shape[1] * view.shape[3] == width, name,
                f"an NZ cache holding N*D={width} elements per token (dim 1 x dim 3)", cache)
        return view, view.shape[2]
    require(cache.dim() in (3, 4) and cache.shape[2:].numel() == width, name,
            f"an ND cache [num_blocks, block_size, N, D] or [num_blocks, block_size, N*D] with N*D={width} "
            "(cache_mode='Norm')", cache)
    return cache.view(cache.shape[0] * cache.shape[1], width), cache.shape[1]


def _slots(slot_mapping: Tensor, tokens: int, capacity: int, device: torch.device) -> tuple[Tensor, Tensor]:
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int32, torch.int64))
    require(slot_mapping.shape[0] == tokens, "slot_mapping", f"one slot per token ({tokens})", slot_mapping)
    slots = slot_mapping.to(device=device, dtype=torch.int64)
    keep = slots >= 0
    if bool((slots[keep] >= capacity).any()):
        fail("slot_mapping", f"slots in [0, num_blocks * block_size = {capacity}) (negative slots are skipped)",
             f"max slot {int(slots.max())}")
    return torch.nonzero(keep).flatten(), slots[keep]


def _scatter(tokens: Tensor, token_name: str, cache: Tensor, cache_name: str, slot_mapping: Tensor,
             nz: bool) -> None:
    check_tensor(token_name, tokens, ndim=3)
    check_tensor(cache_name, cache, device=tokens.device)
    view, block_size = _token_rows(cache, cache_name, tokens, token_name, nz)
    capacity = cache.shape[0] * block_size
    rows, slots = _slots(slot_mapping, tokens.shape[0], capacity, tokens.device)
    data = tokens.reshape(tokens.shape[0], -1)[rows]
    if nz:
        view[slots // block_size, :, slots % block_size, :] = data.view(data.shape[0], view.shape[1], view.shape[3])
    else:
        view[slots] = data


def _check_pair(key: Tensor, value: Tensor) -> None:
    check_tensor("key", key, ndim=3)
    check_tensor("value", value, ndim=3, dtypes=(key.dtype,), device=key.device)
    require(value.shape[:2] == key.shape[:2], "value", f"[T={key.shape[0]}, N={key.shape[1]}, Dv] like key", value)


def npu_scatter_pa_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                            slot_mapping: Tensor, *, compress_lens: Tensor | None = None,
                            compress_seq_offsets: Tensor | None = None, seq_lens: Tensor | None = None,
                            cache_mode: str | None = "PA_NZ") -> None:
    """Write ``key``/``value`` ``[T, N, D]`` into the caches at ``slot_mapping`` ``[T]`` (in place).

    ``cache_mode``: ``"PA_NZ"`` (default, NZ caches) or ``"Norm"``/None (ND caches). The compressed variants
    (``compress_lens``, ``compress_seq_offsets``, ``seq_lens``; 4-D keys) are not supported.
    """
    mode = "Norm" if cache_mode is None else cache_mode
    check_choice("cache_mode", mode, CACHE_MODES)
    for name, arg in (("compress_lens", compress_lens), ("compress_seq_offsets", compress_seq_offsets),
                      ("seq_lens", seq_lens)):
        if arg is not None:
            raise NotImplementedError(f"{name}: the compressed-cache variant of npu_scatter_pa_kv_cache is not "
                                      "supported by attnops (expected None); see docs/porting.md")
    _check_pair(key, value)
    _scatter(key, "key", key_cache, "key_cache", slot_mapping, mode == "PA_NZ")
    _scatter(value, "value", value_cache, "value_cache", slot_mapping, mode == "PA_NZ")


def npu_scatter_pa_kv_cache_functional(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                                       slot_mapping: Tensor, *, compress_lens: Tensor | None = None,
                                       compress_seq_offsets: Tensor | None = None, seq_lens: Tensor | None = None,
                                       cache_mode: str | None = "PA_NZ") -> tuple[Tensor, Tensor]:
    """Out-of-place :func:`npu_scatter_pa_kv_cache`: returns updated copies of the caches."""
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, compress_lens=compress_lens,
                            compress_seq_offsets=compress_seq_offsets, seq_lens=seq_lens, cache_mode=cache_mode)
    return key_cache, value_cache


def _is_nz(cache: Tensor, tokens: Tensor) -> bool:
    """Cache layout from the shapes (torch_npu reads it from the tensor's storage format): ND when
    ``cache.shape[2:]`` is the token's ``[N, D]``, else NZ."""
    return not (cache.dim() == 4 and tuple(cache.shape[2:]) == tuple(tokens.shape[1:]))


def _reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                       slot_indices: Tensor) -> None:
    """ATB's ReshapeAndCache: :func:`npu_scatter_pa_kv_cache` with the layout read from the caches' shapes."""
    _check_pair(key, value)
    _scatter(key, "key", key_cache, "key_cache", slot_indices, _is_nz(key_cache, key))
    _scatter(value, "value", value_cache, "value_cache", slot_indices, _is_nz(value_cache, value))


def _npu_reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                           slot_indices: Tensor) -> None:
    """``torch_npu._npu_reshape_and_cache``: write ``key``/``value`` ``[T, N, D]`` at ``slot_indices`` ``[T]``
    into ND ``[num_blocks, block_size, N, D]`` or NZ caches (in place)."""
    _reshape_and_cache(key, value, key_cache, value_cache, slot_indices)


def _token_slots(block_tables: Tensor, lengths: list[int], seq_offset: list[int] | None, block_size: int,
                 num_blocks: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(valid, slots)`` for every token of every sequence in order: the token's physical slot, and whether its
    block is a real one (out-of-table or invalid block ids read as zeros)."""
    batch = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.int64))
    starts = torch.tensor([0] + lengths[:-1], dtype=torch.int64).cumsum(0)
    pos = torch.arange(batch.numel()) - starts[batch]
    first = torch.tensor(seq_offset, dtype=torch.int64) // block_size if seq_offset is not None else None
    column = pos // block_size + (first[batch] if first is not None else 0)
    table = block_tables.to("cpu", torch.int64)
    inside = column < table.shape[1]
    blocks = torch.where(inside, table[batch, column.clamp(max=table.shape[1] - 1)], -1)
    valid = inside & (blocks >= 0) & (blocks < num_blocks)
    slots = blocks.clamp(min=0) * block_size + pos % block_size
    return valid.to(device), slots.to(device)


def _gather(cache: Tensor, cache_name: str, out: Tensor, out_name: str, valid: Tensor, slots: Tensor) -> None:
    check_tensor(out_name, out, ndim=3, device=cache.device)
    view, block_size = _token_rows(cache, cache_name, out, out_name, _is_nz(cache, out))
    n = min(out.shape[0], slots.numel())
    slots, valid = slots[:n], valid[:n]
    if view.dim() == 4:
        rows = view[slots // block_size, :, slots % block_size, :].reshape(n, -1)
    else:
        rows = view[slots]
    rows = torch.where(valid.unsqueeze(1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    out[:n] = rows.view(n, *out.shape[1:])


def npu_gather_pa_kv_cache(key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                           key: Tensor, value: Tensor, *, seq_offset: Tensor | None = None,
                           is_seq_lens_cumsum: bool = False) -> None:
    """Copy the sequences' tokens out of paged caches into contiguous ``key``/``value`` ``[T, N, D]`` (in place).

    Sequence ``b`` has ``seq_lens[b]`` tokens (with ``is_seq_lens_cumsum``: ``seq_lens`` is ``[0, c1, c2, ...]``
    and the lengths are its differences), read from the blocks ``block_tables[b, seq_offset[b] // block_size:]``;
    the sequences are written one after the other and the copy stops at ``key.shape[0]`` tokens. Blocks outside
    the table or with an invalid id give zeros. The caches are ND ``[num_blocks, block_size, N, D]`` or NZ.
    """
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32, torch.int64))
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32, torch.int64))
    values = [int(v) for v in seq_lens.tolist()]
    if is_seq_lens_cumsum:
        require(values and values[0] == 0 and all(b >= a for a, b in zip(values, values[1:])), "seq_lens",
                "a non-decreasing cumulative list starting at 0 (is_seq_lens_cumsum=True)", values)
        values = [b - a for a, b in zip(values, values[1:])]
    require(all(v >= 0 for v in values), "seq_lens", "non-negative lengths", values)
    require(len(values) <= block_tables.shape[0], "block_tables", f"at least {len(values)} rows (one per sequence)",
            block_tables)
    offsets = None
    if seq_offset is not None:
        check_tensor("seq_offset", seq_offset, ndim=1, shape=(len(values),))
        offsets = [int(v) for v in seq_offset.tolist()]
    _check_pair(key, value)
    _, block_size = _token_rows(key_cache, "key_cache", key, "key", _is_nz(key_cache, key))
    valid, slots = _token_slots(block_tables, values, offsets, block_size, key_cache.shape[0], key.device)
    _gather(key_cache, "key_cache", key, "key", valid, slots)
    _gather(value_cache, "value_cache", value, "value", valid, slots)


def npu_gather_pa_kv_cache_functional(key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                                      seq_lens: Tensor, key: Tensor, value: Tensor, *,
                                      seq_offset: Tensor | None = None,
                                      is_seq_lens_cumsum: bool = False) -> tuple[Tensor, Tensor]:
    """Out-of-place :func:`npu_gather_pa_kv_cache`: returns filled copies of ``key`` and ``value``."""
    key, value = key.clone(), value.clone()
    npu_gather_pa_kv_cache(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset=seq_offset,
                           is_seq_lens_cumsum=is_seq_lens_cumsum)
    return key, value


npu_scatter_pa_kv_cache = with_overloads(npu_scatter_pa_kv_cache)
npu_scatter_pa_kv_cache_functional = with_overloads(npu_scatter_pa_kv_cache_functional)
npu_gather_pa_kv_cache = with_overloads(npu_gather_pa_kv_cache)
npu_gather_pa_kv_cache_functional = with_overloads(npu_gather_pa_kv_cache_functional)
_npu_reshape_and_cache = with_overloads(_npu_reshape_and_cache)
