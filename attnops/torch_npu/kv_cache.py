"""Paged KV-cache writes and reads with torch_npu's signatures: ``npu_scatter_pa_kv_cache``,
``npu_gather_pa_kv_cache`` (and their ``_functional`` forms) and ``_npu_reshape_and_cache``.

Cache layouts (:mod:`.cache_layouts`): ND ``[num_blocks, block_size, N, D]`` (or ``[..., N*D]``) and NZ
``[num_blocks, N*D // x, block_size, x]`` (or ``[num_blocks, N, D // x, block_size, x]``), read from the shapes.
Key and value (and their caches) may have different dtypes in the writes (an int8 key beside a bf16 value, as ATB's
ReshapeAndCache and CANN's ScatterPaKvCache take them); the read takes one dtype, as CANN's GatherPaKvCache does.
Every argument is validated before anything is written.

A slot of -1 skips its token (as the NPU kernel and op-plugin's golden do).

Index values are validated (:mod:`attnops._core.indices`) where they are CPU tensors, unless ``ATTNOPS_VALIDATE=0``
(``=1`` validates device tensors too, reading them back): slots in ``[0, num_blocks * block_size)`` or -1; for the
read, the lengths and offsets, every block id a sequence's tokens use, and outputs with room for every token.
Unvalidated bad values are masked out: a slot outside the cache writes nothing, a block outside the cache (or past
the table) reads zeros, and the read stops at the outputs' length.

Nothing on the GPU path reads a device tensor's values on the host, so the ops are capturable in a CUDA graph. The
write is one Triton launch (:mod:`.triton`) that skips every slot outside ``[0, num_blocks * block_size)``; the read
is one launch that finds each token's sequence and block itself (the reference derives them with torch ops, also
without a host read); both keep every index inside the tensors whatever the values. Two tokens with the same valid
slot leave either one's row there (per element on the GPU).
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from .._core import staging
from .._core.checks import check_choice, check_host_or_same_device, check_tensor, require
from .._core.indices import check_block_table, check_room, check_slots, valid_ids, validation_enabled
from .._core.dispatch import choose_backend
from ._common import with_overloads
from .cache_layouts import ND, NZ, cache_view
from .triton import launch as cache_launch

CACHE_MODES = ("Norm", "PA_NZ")
MODE_LAYOUTS = {"Norm": (ND,), "PA_NZ": (NZ, ND)}  # PA_NZ, the default: NZ, or ND for an ND-only shape
READ_LAYOUTS = (ND, NZ)  # ops without cache_mode: ND where a shape fits both


def _capacity(view: Tensor) -> int:
    return view.shape[0] * view.shape[2]


def _same_device(name: str, x: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``x`` as ``dtype`` on ``device``: already there, or a CPU tensor staged up without blocking."""
    if x.device.type == "cpu" and device.type != "cpu":
        return staging.upload(x, dtype, device)
    require(x.device == device, name, f"a tensor on {device} (the tokens' device) or on the CPU", x)
    return x.to(dtype)


def _check_slots(slot_mapping: Tensor, tokens: int) -> None:
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int32, torch.int64))
    require(slot_mapping.shape[0] == tokens, "slot_mapping", f"one slot per token ({tokens})", slot_mapping)


def _write_reference(tokens: Tensor, view: Tensor, slot_mapping: Tensor) -> None:
    """Plain-indexing write of the tokens whose slot is inside the cache (the others are dropped)."""
    slots = slot_mapping.to(device=tokens.device, dtype=torch.int64)
    rows = torch.nonzero(valid_ids(slots, _capacity(view))).flatten()
    slots = slots[rows]
    block_size = view.shape[2]
    data = tokens.flatten(1)[rows]
    view[slots // block_size, :, slots % block_size, :] = data.view(data.shape[0], view.shape[1], view.shape[3])


def _write_pair(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
                key_layouts: tuple[str, ...], value_layouts: tuple[str, ...]) -> None:
    """Write ``key``/``value`` ``[T, N, D]`` at ``slot_mapping`` into the caches (each read in the first of its
    ``layouts`` its shape fits): one Triton launch on a GPU (slot values read by the kernel, never on the host),
    plain indexing in the reference. Everything is checked before the first write."""
    _check_pair(key, value, same_dtype=False)
    check_tensor("key_cache", key_cache, device=key.device)
    check_tensor("value_cache", value_cache, device=key.device)
    key_view = cache_view(key_cache, "key_cache", key, "key", key_layouts)
    value_view = cache_view(value_cache, "value_cache", value, "value", value_layouts)
    _check_slots(slot_mapping, key.shape[0])
    check_host_or_same_device("key", key, slot_mapping=slot_mapping)
    reference = choose_backend("auto", key.device, lambda: cache_launch.unsupported_reason(key, value)) == "reference"
    if validation_enabled(slot_mapping.device):
        check_slots("slot_mapping", slot_mapping, min(_capacity(key_view), _capacity(value_view)),
                    what="num_blocks * block_size of the caches")
    if reference:
        _write_reference(key, key_view, slot_mapping)
        _write_reference(value, value_view, slot_mapping)
        return
    slots = _same_device("slot_mapping", slot_mapping, slot_mapping.dtype, key.device)
    plan = cache_launch.scatter_plan(slots, key.flatten(1), key_view, value.flatten(1), value_view)
    cache_launch.KERNELS.run_all(plan, key.device)


TOKEN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8)  # int8: quantized caches


def _check_pair(key: Tensor, value: Tensor, *, same_dtype: bool) -> None:
    check_tensor("key", key, ndim=3, dtypes=TOKEN_DTYPES)
    check_tensor("value", value, ndim=3, dtypes=(key.dtype,) if same_dtype else None, device=key.device)
    require(value.shape[:2] == key.shape[:2], "value", f"[T={key.shape[0]}, N={key.shape[1]}, Dv] like key", value)


def npu_scatter_pa_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                            slot_mapping: Tensor, *, compress_lens: Tensor | None = None,
                            compress_seq_offsets: Tensor | None = None, seq_lens: Tensor | None = None,
                            cache_mode: str | None = "PA_NZ") -> None:
    """Write ``key``/``value`` ``[T, N, D]`` into the caches at ``slot_mapping`` ``[T]`` (in place).

    ``cache_mode``: ``"PA_NZ"`` (the default) writes an NZ cache, or an ND one when the cache's shape is ND only
    (``[num_blocks, block_size, N, D]`` with ``block_size != N``, or ``[num_blocks, block_size, N*D]``), as CANN
    picks the scenario from the shapes; ``"Norm"``/None: ND caches only. Key and value may differ in dtype (each
    cache in its token's). The compressed variants (``compress_lens``, ``compress_seq_offsets``, ``seq_lens``; 4-D
    keys) are not supported.
    """
    mode = "Norm" if cache_mode is None else cache_mode
    check_choice("cache_mode", mode, CACHE_MODES)
    for name, arg in (("compress_lens", compress_lens), ("compress_seq_offsets", compress_seq_offsets),
                      ("seq_lens", seq_lens)):
        if arg is not None:
            raise NotImplementedError(f"{name}: the compressed-cache variant of npu_scatter_pa_kv_cache is not "
                                      "supported by attnops (expected None); see docs/porting.md")
    _write_pair(key, value, key_cache, value_cache, slot_mapping, MODE_LAYOUTS[mode], MODE_LAYOUTS[mode])


def npu_scatter_pa_kv_cache_functional(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                                       slot_mapping: Tensor, *, compress_lens: Tensor | None = None,
                                       compress_seq_offsets: Tensor | None = None, seq_lens: Tensor | None = None,
                                       cache_mode: str | None = "PA_NZ") -> tuple[Tensor, Tensor]:
    """Out-of-place :func:`npu_scatter_pa_kv_cache`: returns updated copies of the caches."""
    check_tensor("key_cache", key_cache)
    check_tensor("value_cache", value_cache)
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, compress_lens=compress_lens,
                            compress_seq_offsets=compress_seq_offsets, seq_lens=seq_lens, cache_mode=cache_mode)
    return key_cache, value_cache


def _npu_reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                           slot_indices: Tensor) -> None:
    """``torch_npu._npu_reshape_and_cache`` (ATB's ReshapeAndCache): write ``key``/``value`` ``[T, N, D]`` at
    ``slot_indices`` ``[T]`` into ND ``[num_blocks, block_size, N, D]`` or NZ caches, each layout read from its
    cache's shape (in place). Key and value may differ in dtype (e.g. an int8 key with a bf16 value)."""
    _write_pair(key, value, key_cache, value_cache, slot_indices, READ_LAYOUTS, READ_LAYOUTS)


def _npu_reshape_and_cache_siso(key: Tensor, key_cache: Tensor, slot_indices: Tensor) -> None:
    """``torch_npu._npu_reshape_and_cache_siso`` (ATB's ReshapeAndCache with a single input): write ``key``
    ``[T, N, D]`` at ``slot_indices`` ``[T]`` into ``key_cache`` (ND ``[num_blocks, block_size, N, D]`` or NZ), in
    place; slots outside the cache are dropped. One cache stands for both halves of :func:`_npu_reshape_and_cache`
    (the same rows written to it twice)."""
    _write_pair(key, key, key_cache, key_cache, slot_indices, READ_LAYOUTS, READ_LAYOUTS)


def _check_gather_values(seq_lens: Tensor, cumsum: bool, seq_offset: Tensor | None, block_tables: Tensor,
                         block_size: int, num_blocks: int, key: Tensor) -> None:
    """The read's index values (host copies): lengths, offsets, the block ids each sequence's tokens use and room in
    the outputs for every token."""
    values = seq_lens.detach().to("cpu", torch.int64)
    if cumsum:
        require(values.numel() >= 1 and int(values[0]) == 0 and bool((values.diff() >= 0).all()), "seq_lens",
                "a non-decreasing cumulative list starting at 0 (is_seq_lens_cumsum=True)", values.tolist())
        lengths = values.diff()
    else:
        require(bool((values >= 0).all()), "seq_lens", "non-negative lengths", values.tolist())
        lengths = values
    offsets = torch.zeros_like(lengths)
    if seq_offset is not None:
        offsets = seq_offset.detach().to("cpu", torch.int64)
        require(bool((offsets >= 0).all()), "seq_offset", "non-negative offsets", offsets.tolist())
    total = int(lengths.sum())
    check_room("key", key, 0, total, f"the {total} tokens of seq_lens")
    check_block_table(block_tables[:lengths.numel()], lengths + offsets % block_size, block_size, num_blocks,
                      name="block_tables",
                      lengths_name="seq_lens" if seq_offset is None else "seq_lens, plus seq_offset % block_size",
                      first=offsets // block_size)


def _token_sources(block_tables: Tensor, ends: Tensor, starts: Tensor, offsets: Tensor | None, tokens: int,
                   block_size: int, num_blocks: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(blocks, rows, valid, written)`` of output tokens ``0 .. tokens-1``, derived on the device from the
    sequences' token ranges ``[starts[b], ends[b])``: the cache block and row each token is read from, whether
    that block is a real one (inside the table, id in ``[0, num_blocks)``), and whether the token belongs to a
    sequence at all (the copy stops after the last one). Every index is clamped into range, whatever the values."""
    t = torch.arange(tokens, device=ends.device)
    batch = torch.searchsorted(ends, t, right=True)
    written = batch < ends.shape[0]
    batch = batch.clamp(max=ends.shape[0] - 1)
    pos = t - starts[batch]
    column = pos.div(block_size, rounding_mode="floor")
    if offsets is not None:
        column = column + offsets[batch].div(block_size, rounding_mode="floor")
    width = block_tables.shape[1]
    valid = (pos >= 0) & (column >= 0) & (column < width)
    if width == 0 or num_blocks == 0:
        zeros = torch.zeros_like(t)
        return zeros, zeros, torch.zeros_like(valid), written
    blocks = block_tables[batch, column.clamp(0, width - 1)].to(torch.int64)
    valid &= (blocks >= 0) & (blocks < num_blocks)
    return blocks.clamp(0, num_blocks - 1), pos.remainder(block_size), valid, written


def _gather(view: Tensor, out: Tensor, blocks: Tensor, rows: Tensor, valid: Tensor, written: Tensor) -> None:
    """``out[t]`` = the cache row of token ``t`` (0 where its block is invalid; unchanged where not written)."""
    data = view[blocks, :, rows, :].reshape(out.shape)
    data = torch.where(valid.view(-1, 1, 1), data, 0)
    out.copy_(torch.where(written.view(-1, 1, 1), data, out))


def npu_gather_pa_kv_cache(key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                           key: Tensor, value: Tensor, *, seq_offset: Tensor | None = None,
                           is_seq_lens_cumsum: bool = False) -> None:
    """Copy the sequences' tokens out of paged caches into contiguous ``key``/``value`` ``[T, N, D]`` (in place).

    Sequence ``b`` has ``seq_lens[b]`` tokens (with ``is_seq_lens_cumsum``: ``seq_lens`` is ``[0, c1, c2, ...]``
    and the lengths are its differences), read from the blocks ``block_tables[b, seq_offset[b] // block_size:]``;
    the sequences are written one after the other and the copy stops at ``key.shape[0]`` tokens (rows past the
    last sequence are left as they are). The caches are ND ``[num_blocks, block_size, N, D]`` or NZ, with one block
    size. On a GPU one Triton launch reads the lengths, offsets and table itself. With CPU ``seq_lens`` (unless
    ``ATTNOPS_VALIDATE=0``) the values are validated: ``key``/``value`` must have room for every token and every
    block a sequence uses must be in the cache; unvalidated, the copy stops at ``key.shape[0]`` tokens and blocks
    outside the table or the cache give zeros.
    """
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32, torch.int64))
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32, torch.int64))
    batch = seq_lens.shape[0] - 1 if is_seq_lens_cumsum else seq_lens.shape[0]
    require(batch >= 0, "seq_lens", "a cumulative list starting at 0 (is_seq_lens_cumsum=True)", seq_lens)
    require(batch <= block_tables.shape[0], "block_tables", f"at least {batch} rows (one per sequence)",
            block_tables)
    if seq_offset is not None:
        check_tensor("seq_offset", seq_offset, ndim=1, shape=(batch,), dtypes=(torch.int32, torch.int64))
    _check_pair(key, value, same_dtype=True)
    check_host_or_same_device("key", key, block_tables=block_tables, seq_lens=seq_lens, seq_offset=seq_offset)
    check_tensor("key_cache", key_cache, device=key.device)
    check_tensor("value_cache", value_cache, device=key.device)
    key_view = cache_view(key_cache, "key_cache", key, "key", READ_LAYOUTS)
    value_view = cache_view(value_cache, "value_cache", value, "value", READ_LAYOUTS)
    block_size = key_view.shape[2]
    require(value_view.shape[2] == block_size, "value_cache", f"block_size {block_size} like key_cache", value_cache)
    num_blocks = min(key_view.shape[0], value_view.shape[0])
    if validation_enabled(seq_lens.device):
        _check_gather_values(seq_lens, is_seq_lens_cumsum, seq_offset, block_tables, block_size, num_blocks, key)
    if batch == 0:
        return
    device = key.device
    lens = _same_device("seq_lens", seq_lens, seq_lens.dtype, device)
    offsets = None if seq_offset is None else _same_device("seq_offset", seq_offset, seq_offset.dtype, device)
    table = _same_device("block_tables", block_tables, block_tables.dtype, device)
    if choose_backend("auto", device, lambda: cache_launch.unsupported_reason(key)) == "reference":
        lens = lens.to(torch.int64)
        ends, starts = (lens[1:], lens[:-1]) if is_seq_lens_cumsum else (lens.cumsum(0), lens.cumsum(0) - lens)
        sources = _token_sources(table, ends, starts, offsets, key.shape[0], block_size, num_blocks)
        _gather(key_view, key, *sources)
        _gather(value_view, value, *sources)
        return
    with _writable_rows(key) as key_rows, _writable_rows(value) as value_rows:
        plan = cache_launch.gather_plan(lens, is_seq_lens_cumsum, offsets, table, num_blocks, key_rows, key_view,
                                        value_rows, value_view)
        cache_launch.KERNELS.run_all(plan, device)


def npu_paged_cache_load(key_cache: Tensor, value_cache: Tensor, block_table: Tensor, context_lens: Tensor, *,
                         seq_starts: Tensor | None = None, cumsum: bool = False, key: Tensor | None = None,
                         value: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``torch_npu.atb.npu_paged_cache_load`` (ATB's PagedCacheLoad): the sequences' tokens of paged caches
    ``[num_blocks, block_size, N, D]`` as contiguous ``key``/``value`` ``[num_tokens, N, D]``, written into the given
    ones or into new tensors (``num_tokens``: the sum of ``context_lens``, or its last entry with ``cumsum``).
    Sequence ``b`` reads the blocks ``block_table[b, seq_starts[b] // block_size:]``. :func:`npu_gather_pa_kv_cache`
    with ``seq_offset=seq_starts`` and ``is_seq_lens_cumsum=cumsum``."""
    check_tensor("context_lens", context_lens, ndim=1, dtypes=(torch.int32, torch.int64))
    check_tensor("key_cache", key_cache, ndim=4)
    check_tensor("value_cache", value_cache, ndim=4, device=key_cache.device)
    if key is None or value is None:
        lens = context_lens.detach().to("cpu", torch.int64)
        require(bool((lens >= 0).all()), "context_lens", "non-negative lengths", lens.tolist())
        tokens = (int(lens[-1]) if lens.numel() else 0) if cumsum else int(lens.sum())
        key = key_cache.new_empty(tokens, *key_cache.shape[2:]) if key is None else key
        value = value_cache.new_empty(tokens, *value_cache.shape[2:]) if value is None else value
    # the caches are only read: strided views (e.g. column slices of one MLA cache) are read through a copy
    npu_gather_pa_kv_cache(key_cache.contiguous(), value_cache.contiguous(), block_table, context_lens, key, value,
                           seq_offset=seq_starts, is_seq_lens_cumsum=cumsum)
    return key, value


def gather_sequences(key_cache: Tensor, value_cache: Tensor, block_table: Tensor, lens: list[int]
                     ) -> tuple[Tensor, Tensor]:
    """The callers' form of :func:`npu_paged_cache_load`: host lengths ``lens`` (already checked by the caller),
    staged to the caches' device without blocking, so the block table is never read on the host."""
    tokens = sum(lens)
    key = key_cache.new_empty(tokens, *key_cache.shape[2:])
    value = value_cache.new_empty(tokens, *value_cache.shape[2:])
    npu_gather_pa_kv_cache(key_cache.contiguous(), value_cache.contiguous(), block_table,
                           staging.upload(lens, torch.int32, key_cache.device), key, value)
    return key, value


@contextlib.contextmanager
def _writable_rows(out: Tensor):
    """``out [T, N, D]`` as ``[T, N*D]`` rows with a unit last stride for a kernel to write: a view when the strides
    allow, else a copy written back afterwards."""
    try:
        rows = out.view(out.shape[0], out.shape[1] * out.shape[2])
    except RuntimeError:
        rows = None
    if rows is not None and (rows.stride(1) == 1 or rows.shape[1] <= 1):
        yield rows
        return
    rows = out.reshape(out.shape[0], out.shape[1] * out.shape[2]).contiguous()
    yield rows
    out.copy_(rows.view(out.shape))


def npu_gather_pa_kv_cache_functional(key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                                      seq_lens: Tensor, key: Tensor, value: Tensor, *,
                                      seq_offset: Tensor | None = None,
                                      is_seq_lens_cumsum: bool = False) -> tuple[Tensor, Tensor]:
    """Out-of-place :func:`npu_gather_pa_kv_cache`: returns filled copies of ``key`` and ``value``."""
    check_tensor("key", key)
    check_tensor("value", value)
    key, value = key.clone(), value.clone()
    npu_gather_pa_kv_cache(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset=seq_offset,
                           is_seq_lens_cumsum=is_seq_lens_cumsum)
    return key, value


npu_scatter_pa_kv_cache = with_overloads(npu_scatter_pa_kv_cache)
npu_scatter_pa_kv_cache_functional = with_overloads(npu_scatter_pa_kv_cache_functional)
npu_gather_pa_kv_cache = with_overloads(npu_gather_pa_kv_cache)
npu_gather_pa_kv_cache_functional = with_overloads(npu_gather_pa_kv_cache_functional)
_npu_reshape_and_cache = with_overloads(_npu_reshape_and_cache)
_npu_reshape_and_cache_siso = with_overloads(_npu_reshape_and_cache_siso)
npu_paged_cache_load = with_overloads(npu_paged_cache_load, out=npu_paged_cache_load)
