"""``DSV4Cache``: the decoding state of one :class:`~attnops.nn.DeepSeekV4Attention` layer.

Paged stores ``[blocks, block_size, 1, D]`` read through block tables ``[B, blocks per sequence]`` (the
``PA_BBND`` layout of :func:`attnops.sparse_flash_mla` and :func:`attnops.lightning_indexer_v2`):

* ``window``: the uncompressed KV rows the sliding window reads (token ``p`` at ``window_table[b, p // bs]``);
* ``compressed``: one row per complete block of ``cmp_ratio`` tokens (C4A rows of a CSA layer, C128A rows of an HCA
  layer), read through ``compressed_table``;
* ``index_keys`` (CSA layers): the indexer's compressed keys, through ``compressed_table`` as well;
* ``kv_state`` / ``index_state``: the compressors' fp32 ``[kv | score]`` rings (``cache_mode=2`` of
  :func:`attnops.compressor`: one block of ``coff * cmp_ratio`` slots per sequence), which hold the tokens of the
  blocks not yet complete.

Everything is allocated once for ``max_len`` tokens per sequence; the rows of a batch advance together. A cache
belongs to one layer: the first call binds it (the layer held weakly, with its settings), later calls by another
layer, or by the same layer after its settings changed, raise.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from .._core.checks import Described, check_int, check_tensor, fail, require


def _paged(rows: int, batch: int, block_size: int, width: int, dtype, device) -> tuple[Tensor, Tensor]:
    """A zeroed store ``[batch * per_seq, block_size, 1, width]`` for ``rows`` rows per sequence and its block table
    ``[batch, per_seq]`` (int32, sequence ``b`` owning consecutive blocks)."""
    per_seq = max(1, -(-rows // block_size))
    store = torch.zeros(batch * per_seq, block_size, 1, width, dtype=dtype, device=device)
    table = torch.arange(batch * per_seq, dtype=torch.int32, device=device).view(batch, per_seq)
    return store, table


def _write(store: Tensor, table: Tensor, first: int, rows: Tensor) -> None:
    """Store ``rows [B, n, width]`` at the logical positions ``[first, first + n)`` of every sequence."""
    batch, n = rows.shape[:2]
    if n == 0:
        return
    bs = store.shape[1]
    pos = torch.arange(first, first + n, device=store.device)
    blocks = table.long()[:, pos // bs]  # [B, n]
    store[blocks, pos % bs, 0] = rows.detach().to(store.dtype)


class DSV4Cache:
    """The paged window KV, compressed KV, indexer keys and compressor states of ``batch`` sequences of up to
    ``max_len`` tokens (make it with :meth:`DeepSeekV4Attention.new_cache`). ``seq_len``: tokens per sequence so
    far; ``lengths(n)``: an int32 ``[B]`` tensor of ``n`` for the operators."""

    def __init__(self, batch: int, max_len: int, *, head_dim: int, cmp_ratio: int, coff: int,
                 index_dim: int | None = None, block_size: int = 64, dtype: torch.dtype = torch.float32,
                 device=None):
        self.batch = check_int("batch", batch, lo=1)
        self.max_len = check_int("max_len", max_len, lo=1)
        self.cmp_ratio = check_int("cmp_ratio", cmp_ratio, lo=2)
        self.coff = check_int("coff", coff, lo=1, hi=2)
        self.block_size = check_int("block_size", block_size, lo=1)
        self.head_dim, self.index_dim = check_int("head_dim", head_dim, lo=1), index_dim
        ring = coff * cmp_ratio
        self.window, self.window_table = _paged(max_len, batch, block_size, head_dim, dtype, device)
        self.compressed, self.compressed_table = _paged(max_len // cmp_ratio, batch, block_size, head_dim, dtype,
                                                        device)
        self.state_table = torch.arange(batch, dtype=torch.int32, device=device)
        self.kv_state = torch.zeros(batch, ring, 2 * coff * head_dim, dtype=torch.float32, device=device)
        self.index_keys = self.index_state = None
        if index_dim is not None:
            self.index_dim = check_int("index_dim", index_dim, lo=1)
            self.index_keys = torch.zeros(*self.compressed.shape[:3], index_dim, dtype=dtype, device=device)
            self.index_state = torch.zeros(batch, ring, 4 * index_dim, dtype=torch.float32, device=device)
        self.seq_len = 0
        self.layer_settings: dict[str, Any] | None = None
        self._owner: weakref.ref | None = None

    def __repr__(self) -> str:
        return (f"DSV4Cache(batch={self.batch}, seq_len={self.seq_len}, max_len={self.max_len}, "
                f"cmp_ratio={self.cmp_ratio}, sparse={self.index_keys is not None})")

    def nbytes(self) -> int:
        """Bytes held by the stores, states and tables."""
        held = [self.window, self.window_table, self.compressed, self.compressed_table, self.kv_state,
                self.state_table, self.index_keys, self.index_state]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def lengths(self, n: int) -> Tensor:
        """``[B]`` int32 of ``n`` (on the host: the operators read lengths there)."""
        return torch.full((self.batch,), n, dtype=torch.int32)

    def bind(self, layer: Any, settings: dict[str, Any]) -> None:
        """Tie the cache to ``layer`` at its first call, or check it is that layer's with the same settings."""
        if self._owner is None:
            mine = dict(head_dim=self.head_dim, cmp_ratio=self.cmp_ratio, coff=self.coff, index_dim=self.index_dim)
            differ = ", ".join(f"{k}={v!r} (this layer: {settings.get(k)!r})" for k, v in mine.items()
                               if settings.get(k) != v)
            require(not differ, "cache", "a cache with this layer's sizes", Described(f"a cache with {differ}"),
                    "Make it with layer.new_cache(batch, max_len)")
            self._owner, self.layer_settings = weakref.ref(layer), dict(settings)
            return
        if self._owner() is not layer or settings != self.layer_settings:
            got = "the cache of another layer" if self._owner() is not layer else \
                "a cache made when this layer had other settings"
            fail("cache", "a cache made by this layer's new_cache()", Described(got),
                 "A cache holds one layer's keys: make one per layer, e.g. caches = [layer.new_cache(batch, max_len)"
                 " for layer in layers], and call layers[i](x, cache=caches[i])")

    def check_append(self, x: Tensor) -> None:
        """Check that ``x [B, n, hidden]`` fits: the cache's batch, room for ``n`` more tokens."""
        check_tensor("x", x, ndim=3)
        require(x.shape[0] == self.batch, "x", f"[B={self.batch} (the cache's), S, hidden]", x)
        require(self.seq_len + x.shape[1] <= self.max_len, "x",
                f"at most {self.max_len - self.seq_len} new tokens (max_len={self.max_len}, {self.seq_len} cached)",
                Described(f"{x.shape[1]} tokens"))

    def append(self, window: Tensor, compressed: Tensor, index_keys: Tensor | None) -> None:
        """Store the new tokens' window rows ``[B, n, D]`` and the compressed rows ``[B, c, D]`` (and indexer keys
        ``[B, c, Di]``) of the blocks they complete; ``seq_len`` advances by ``n``."""
        _write(self.window, self.window_table, self.seq_len, window)
        first = self.seq_len // self.cmp_ratio
        _write(self.compressed, self.compressed_table, first, compressed)
        if self.index_keys is not None:
            _write(self.index_keys, self.compressed_table, first, index_keys)
        self.seq_len += window.shape[1]
