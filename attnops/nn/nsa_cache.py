"""``NSACache``: the decoding state of one :class:`~attnops.nn.NativeSparseAttention` layer.

Keys (after RoPE) and values live in a pool of pages ``[pages, page_size, N2, D]`` read through ``block_table
[B, pages per sequence]`` (the layout of :func:`attnops.nsa_selected_attention_infer`); the compressed keys/values
of the complete compression blocks in ``[B, capacity, N2, D]``. Storage grows by whole pages (and compressed rows)
with geometric over-allocation, so appending costs O(new tokens) amortised; with ``max_seq_len`` everything is
allocated once, at the first append. The rows of a batch advance together.

Everything lives on the device of the keys: the block table (built on the host when pages are added, staged without
a synchronisation) and ``lengths``, the per-sequence token counts the decoding reads on the device. A decoding step
takes its positions from ``lengths`` and advances it there, so with ``max_seq_len`` (fixed storage) a step can be
captured in a CUDA graph and replayed token after token; the host's ``seq_len`` counts the calls Python made
(:meth:`NSACache.advance` adds the tokens replays appended).

A cache belongs to one layer: :meth:`NSACache.bind` records the layer (its identity, held weakly) and its settings
at :meth:`NativeSparseAttention.new_cache` (or at the first call of a cache constructed directly), and every later
call checks them, so a cache shared by two layers, or passed to a layer with other settings, raises.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from .._core import staging
from .._core.checks import Described, check_int, check_same_device, check_tensor, fail, require
from ..ops.nsa.compress import compress_block_count
from ..ops.nsa.compress_attention import check_block_sizes
from ..ops.nsa.layer import block_of


def _grown(store: Tensor | None, rows: int, capacity: int | None, like: Tensor, dim: int) -> Tensor:
    """``store`` with room for ``rows`` entries along ``dim``: doubled, or ``capacity`` at once when known; the new
    entries zero."""
    have = 0 if store is None else store.shape[dim]
    if store is not None and rows <= have:
        return store
    size = list(like.shape)
    size[dim] = (max(rows, 2 * have) if capacity is None else max(rows, capacity)) - have
    extra = like.new_zeros(size)
    return extra if store is None else torch.cat([store, extra], dim)


def _differences(cache: dict[str, Any], layer: dict[str, Any]) -> str:
    """``name=cache's value (this layer: layer's value)`` for every setting of ``cache`` the layer gives otherwise."""
    return ", ".join(f"{k}={v!r} (this layer: {layer.get(k)!r})" for k, v in cache.items() if layer.get(k) != v)


class NSACache:
    """Paged keys/values and compressed keys/values of ``batch_size`` sequences (from
    :meth:`NativeSparseAttention.new_cache`). ``forward(x, cache=cache)`` appends ``x``'s tokens and updates it.

    * ``key_pages``, ``value_pages`` ``[pages, page_size, N2, D]`` and ``block_table [B, pages per sequence]``
      (int32): token ``p`` of sequence ``b`` is row ``p % page_size`` of page ``block_table[b, p // page_size]``;
    * ``compressed_keys``, ``compressed_values`` ``[B, capacity, N2, D]``: row ``c`` (``c < compressed_len``)
      pools tokens ``[c*stride, c*stride + block)``, written when the token ``c*stride + block - 1`` arrives;
      ``capacity`` covers the rows a decoding step attends (:meth:`compressed_rows`);
    * ``lengths [B]`` (int64, on the keys' device): the tokens of each sequence (all equal: the rows advance
      together);
    * ``layer_settings``: the settings of the layer the cache belongs to (None until it is bound, see :meth:`bind`).
    """

    def __init__(self, batch_size: int, *, compress_block_size: int, compress_stride: int, page_size: int,
                 max_seq_len: int | None = None, select_block_size: int | None = None,
                 select_block_count: int = 1):
        self.batch_size = check_int("batch_size", batch_size, lo=1)
        self.max_seq_len = None if max_seq_len is None else check_int("max_seq_len", max_seq_len, lo=1)
        self.page_size = check_int("page_size", page_size, lo=1)
        if select_block_size is None:  # no selection: the compression sizes only
            self.compress_block_size = check_int("compress_block_size", compress_block_size, lo=1)
            self.compress_stride = check_int("compress_stride", compress_stride, lo=1, hi=compress_block_size)
            self.select_block_count = check_int("select_block_count", select_block_count, lo=1)
            self.select_block_size = None
        else:
            (self.compress_block_size, self.compress_stride, self.select_block_size,
             self.select_block_count) = check_block_sizes(compress_block_size, compress_stride, select_block_size,
                                                          select_block_count)
        self.key_pages = self.value_pages = None
        self.compressed_keys = self.compressed_values = None
        self._host_table = torch.zeros(self.batch_size, 0, dtype=torch.int32)  # the block table as the host built it
        self.block_table = self._host_table
        self.lengths = torch.zeros(self.batch_size, dtype=torch.int64)
        self.compressed_len = 0
        self._len = 0
        self.layer_settings: dict[str, Any] | None = None
        self._owner_id: int | None = None  # id() of the layer: compared under torch.compile, which traces id()
        self._owner: weakref.ref | None = None  # the layer itself, weakly: an id a dead layer's successor reuses

    def bind(self, layer: Any, settings: dict[str, Any]) -> None:
        """Tie the cache to ``layer`` with ``settings`` (its sizes, head counts and branch options) at its first use,
        or check that it is that layer's: any other layer, even one with equal settings (a copy of the layer, or
        another layer of the same model), raises, since its keys and compressed rows are not this cache's. An unbound
        cache (constructed directly) must have the layer's compression and selection sizes."""
        if self._owner_id is None:
            mine = dict(compress_block_size=self.compress_block_size, compress_stride=self.compress_stride,
                        select_block_size=self.select_block_size, select_block_count=self.select_block_count)
            differ = _differences(mine, settings)
            require(not differ, "cache", "a cache with this layer's sizes", Described(f"a cache with {differ}"),
                    "Make it with layer.new_cache(batch_size)")
            self._owner_id, self._owner, self.layer_settings = id(layer), weakref.ref(layer), dict(settings)
            return
        same = self._owner_id == id(layer) and (torch.compiler.is_compiling() or self._owner() is layer)
        if not same or settings != self.layer_settings:
            differ = _differences(self.layer_settings, settings)
            got = "the cache of another layer" if not same else "a cache made when this layer had other settings"
            fail("cache", "a cache made by this layer's new_cache()",
                 Described(got + (f" ({differ})" if differ else "")),
                 "A cache holds one layer's keys: make one cache per layer, e.g. caches = [layer.new_cache(batch_size)"
                 " for layer in layers], and call layers[i](x, cache=caches[i])")

    @property
    def seq_len(self) -> int:
        """Tokens per sequence so far (as the host counts them: the calls Python made, plus :meth:`advance`)."""
        return self._len

    @property
    def capacity(self) -> int:
        """Tokens per sequence the allocated pages hold."""
        return self.block_table.shape[1] * self.page_size

    def advance(self, steps: int) -> None:
        """Count ``steps`` more tokens on the host: those that replays of a captured decoding step appended (they
        advance ``lengths`` on the device only)."""
        steps = check_int("steps", steps, lo=0)
        require(self._len + steps <= self.capacity, "steps", f"at most {self.capacity - self._len} (the pages' room)",
                steps)
        self._len += steps
        self.compressed_len = compress_block_count(self._len, self.compress_block_size, self.compress_stride)

    def __repr__(self) -> str:
        return (f"NSACache(batch_size={self.batch_size}, seq_len={self._len}, compressed_len={self.compressed_len}, "
                f"page_size={self.page_size}, pages={0 if self.key_pages is None else self.key_pages.shape[0]})")

    def nbytes(self) -> int:
        """Bytes held by the cache's storage (pages, compressed rows and the block table)."""
        held = [self.key_pages, self.value_pages, self.compressed_keys, self.compressed_values, self.block_table]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def append(self, k: Tensor, v: Tensor) -> None:
        """Store ``k``, ``v [B, t, N2, D]`` (detached) after the cached tokens: at the positions ``lengths`` holds on
        the device, which then advances by ``t`` (``t = 0``: nothing changes)."""
        self._check_keys(k, v)
        t = k.shape[1]
        self._check_room(t)
        if t == 0:
            return
        self._reserve(self._len + t, k, v)
        page, row = self._slots(self.positions(t, k.device))
        self.key_pages[page, row] = k.detach()
        self.value_pages[page, row] = v.detach()
        self._advance_lengths(t)

    def store(self, k: Tensor, v: Tensor, slots: Tensor) -> None:
        """:meth:`append` for a decoding step whose pages are reserved (:meth:`reserve_for`) and whose flat page rows
        ``slots [B, t]`` (``page * page_size + row``) are looked up (:func:`attnops.nn.nsa_step.decode_step`)."""
        self._check_keys(k, v)
        self.key_pages.view(-1, *self.key_pages.shape[2:])[slots] = k.detach()
        self.value_pages.view(-1, *self.value_pages.shape[2:])[slots] = v.detach()
        self._advance_lengths(k.shape[1])

    def _check_keys(self, k: Tensor, v: Tensor) -> None:
        """``k``, ``v [B, t, N2, D]`` of the cache's batch, and of its heads, dtype and device once it holds keys."""
        check_tensor("k", k, ndim=4)
        require(k.shape[0] == self.batch_size, "k", f"[B={self.batch_size} (the cache's), t, N2, D]", k)
        check_tensor("v", v, shape=(*k.shape[:3], None), dtypes=(k.dtype,))
        check_same_device("k", k, v=v)
        if self.key_pages is not None:
            require(k.shape[2:] == self.key_pages.shape[2:] and v.shape[3] == self.value_pages.shape[3]
                    and k.dtype == self.key_pages.dtype and k.device == self.key_pages.device, "cache",
                    f"keys of the cached heads, dtype and device ([N2, D] = {list(self.key_pages.shape[2:])}, "
                    f"{self.key_pages.dtype}, {self.key_pages.device})",
                    Described(f"keys {list(k.shape[2:])}, {k.dtype}, {k.device}"),
                    "A cache keeps the dtype and device of its first call: after layer.to(...), make a new one with "
                    "layer.new_cache(batch_size)")

    def _advance_lengths(self, t: int) -> None:
        """Count ``t`` appended tokens, on the host and in ``lengths``."""
        self._len += t
        self.lengths.add_(t)

    def _check_room(self, t: int) -> None:
        """``t`` more tokens fit in ``max_seq_len``."""
        if self.max_seq_len is not None:
            require(self._len + t <= self.max_seq_len, "x", f"at most max_seq_len={self.max_seq_len} tokens in all",
                    self._len + t)

    def reserve_for(self, t: int) -> None:
        """Pages (and compressed rows) for ``t`` more tokens per sequence, before they are appended (a cache that
        holds tokens already: its storage gives the dtype, device and head shape)."""
        self._check_room(t)
        if self._len + t > self.capacity:
            keys, values = self.key_pages, self.value_pages
            self._reserve(self._len + t, keys.new_empty(self.batch_size, 0, *keys.shape[2:]),
                          values.new_empty(self.batch_size, 0, *values.shape[2:]))

    def lengths_on(self, device: torch.device) -> Tensor:
        """``lengths`` on ``device`` (moved there at the first call)."""
        if self.lengths.device != device:
            self.lengths = torch.zeros(self.batch_size, dtype=torch.int64, device=device).add_(self._len)
        return self.lengths

    def positions(self, t: int, device: torch.device) -> Tensor:
        """``[B, t]`` int64 on ``device`` (the inputs'): the positions of the next ``t`` tokens (from ``lengths``,
        placed on that device at the first call)."""
        return self.lengths_on(device)[:, None] + _offsets(t, device)

    def _slots(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """``(page, row)`` of the positions ``pos [B, t]`` (clamped into the block table: a replay past the pages
        overwrites the last one instead of writing out of bounds)."""
        col = block_of(pos, self.page_size).clamp_max(self.block_table.shape[1] - 1)
        return self.block_table.long().gather(1, col), pos % self.page_size

    def truncate(self, length: int) -> None:
        """Forget the tokens after the first ``length`` (e.g. rejected draft tokens); their pages stay allocated
        and are overwritten by the next append."""
        check_int("length", length, lo=0, hi=self._len)
        self._len = length
        self.lengths.fill_(length)
        self.compressed_len = min(self.compressed_len,
                                  compress_block_count(length, self.compress_block_size, self.compress_stride))

    def _reserve(self, length: int, k: Tensor, v: Tensor) -> None:
        """Pages for ``length`` tokens per sequence; new page ids go row by row after the pool's (the block table is
        built on the host and staged to the keys' device)."""
        have, want = self.block_table.shape[1], -(-length // self.page_size)
        if want <= have:
            return
        if self.max_seq_len is None:
            new = max(want, 2 * have) - have
        else:
            new = -(-self.max_seq_len // self.page_size) - have
        pool = 0 if self.key_pages is None else self.key_pages.shape[0]
        ids = pool + torch.arange(new * self.batch_size, dtype=torch.int32).view(new, self.batch_size).T
        self._host_table = torch.cat([self._host_table, ids], 1)
        self.block_table = staging.upload(self._host_table, torch.int32, k.device)
        total = pool + new * self.batch_size
        self.key_pages = _grown(self.key_pages, total, total, k.new_empty(0, self.page_size, *k.shape[2:]), 0)
        self.value_pages = _grown(self.value_pages, total, total, v.new_empty(0, self.page_size, *v.shape[2:]), 0)
        self.reserve_compressed(k[:, :0], v[:, :0])  # the compressed rows of the new pages

    def rows(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        """Cached keys and values of the tokens ``[start, end)``: ``[B, end - start, N2, D]`` each."""
        require(0 <= start <= end <= self._len and self.key_pages is not None, "end",
                f"a token range within the {self._len} cached tokens", (start, end))
        pos = torch.arange(start, end, device=self.key_pages.device)
        page = self.block_table.long()[:, pos // self.page_size]
        return self.key_pages[page, pos % self.page_size], self.value_pages[page, pos % self.page_size]

    def pending_compression(self) -> tuple[int, int]:
        """``(first, end)``: the compression blocks complete in the cached tokens but not yet compressed."""
        return self.compressed_len, compress_block_count(self._len, self.compress_block_size, self.compress_stride)

    def compressed_rows(self) -> int:
        """Compressed rows a decoding step attends (and the store holds): those of the selection blocks covering the
        pages, at least ``select_block_count`` blocks (``compress_block_count`` of the pages without a selection
        block size)."""
        if self.select_block_size is None:
            return compress_block_count(self.capacity, self.compress_block_size, self.compress_stride)
        blocks = max(self.select_block_count, -(-self.capacity // self.select_block_size))
        return blocks * (self.select_block_size // self.compress_stride)

    def add_compressed(self, k_cmp: Tensor, v_cmp: Tensor) -> None:
        """Store the next compressed rows ``[B, c, N2, D]`` (detached)."""
        check_tensor("k_cmp", k_cmp, ndim=4)
        check_tensor("v_cmp", v_cmp, shape=(*k_cmp.shape[:2], None, None))
        first, end = self.pending_compression()
        require(k_cmp.shape[1] == end - first, "k_cmp", f"{end - first} compressed rows (blocks {first}..{end - 1})",
                k_cmp.shape[1])
        self.reserve_compressed(k_cmp[:, :0], v_cmp[:, :0], end)
        self.compressed_keys[:, first:end] = k_cmp.detach()
        self.compressed_values[:, first:end] = v_cmp.detach()
        self.compressed_len = end

    def reserve_compressed(self, k_like: Tensor, v_like: Tensor, rows: int = 0) -> None:
        """Room for ``max(rows, compressed_rows())`` compressed rows (``k_like``/``v_like``: ``[B, 0, N2, D]``)."""
        want = max(rows, self.compressed_rows())
        self.compressed_keys = _grown(self.compressed_keys, want, want, k_like, 1)
        self.compressed_values = _grown(self.compressed_values, want, want, v_like, 1)


@staging.device_constant(16)
def _offsets(t: int, device: torch.device) -> Tensor:
    """``arange(t)`` on ``device`` (made once per size; read only)."""
    return torch.arange(t, device=device)
