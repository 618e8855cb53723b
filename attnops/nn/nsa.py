"""``NativeSparseAttention``: an NSA attention layer (projections, RoPE, three branches, output projection)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .._core.checks import check_int, check_tensor, fail, require
from .._core.varlen import cumulative_from_cu_seqlens, lengths_from_cumulative
from ..ops.nsa.layer import COMPRESS_MODES, native_sparse_attention
from .rotary import apply_rotary


@dataclass
class NSACache:
    """Keys (after RoPE) and values of the tokens seen so far, ``[B, S, N2, D/Dv]`` (from
    :meth:`NativeSparseAttention.new_cache`); ``forward(x, cache=cache)`` appends a chunk and updates it in place."""

    batch_size: int
    max_seq_len: int | None = None
    keys: Tensor | None = field(default=None, repr=False)
    values: Tensor | None = field(default=None, repr=False)

    @property
    def seq_len(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        require(k.shape[0] == self.batch_size, "x", f"a batch of {self.batch_size} (the cache's)", k.shape[0])
        new_len = self.seq_len + k.shape[1]
        if self.max_seq_len is not None:
            require(new_len <= self.max_seq_len, "x", f"at most max_seq_len={self.max_seq_len} tokens in all",
                    new_len)
        self.keys = k if self.keys is None else torch.cat([self.keys, k], 1)
        self.values = v if self.values is None else torch.cat([self.values, v], 1)
        return self.keys, self.values


class NativeSparseAttention(nn.Module):
    """Native Sparse Attention layer (DeepSeek, arXiv 2502.11089) over :func:`attnops.native_sparse_attention`.

    ``x -> q, k, v`` (linear, no bias), RoPE on q and k (``rope_theta``, rotate-half), per-head sigmoid gates
    ``[.., N1, 3]`` (compression, selection, window) from a linear projection of ``x``, the three branches, then the
    output projection. Keys are compressed **after** RoPE (each key rotated at its own position, then pooled);
    values carry no rotation. ``compress="weighted"`` learns ``compress_weight_k/v [compress_block_size,
    num_kv_heads]`` (initialised to the mean); ``"mean"`` has no compression weights. Positions restart at 0 for
    each sequence.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 compress_block_size: int = 32, compress_stride: int = 16, select_block_size: int = 64,
                 select_block_count: int = 16, window_size: int = 512, rope_theta: float = 10000.0,
                 compress: str = "weighted"):
        super().__init__()
        n1 = check_int("num_heads", num_heads, lo=1)
        n2 = check_int("num_kv_heads", num_kv_heads, lo=1)
        require(n1 % n2 == 0, "num_kv_heads", f"a divisor of num_heads={n1}", n2)
        d = check_int("head_dim", head_dim, lo=2)
        require(d % 2 == 0, "head_dim", "an even number (RoPE)", d)
        require(compress in COMPRESS_MODES, "compress", f"one of {COMPRESS_MODES}", compress)
        self.num_heads, self.num_kv_heads, self.head_dim = n1, n2, d
        self.config = dict(compress_block_size=compress_block_size, compress_stride=compress_stride,
                           select_block_size=select_block_size, select_block_count=select_block_count,
                           window_size=window_size, compress=compress)
        self.rope_theta = float(rope_theta)
        self.q_proj = nn.Linear(hidden_size, n1 * d, bias=False)
        self.k_proj = nn.Linear(hidden_size, n2 * d, bias=False)
        self.v_proj = nn.Linear(hidden_size, n2 * d, bias=False)
        self.g_proj = nn.Linear(hidden_size, n1 * 3)
        self.o_proj = nn.Linear(n1 * d, hidden_size, bias=False)
        if compress == "weighted":
            init = torch.full((compress_block_size, n2), 1.0 / compress_block_size)
            self.compress_weight_k = nn.Parameter(init.clone())
            self.compress_weight_v = nn.Parameter(init.clone())
        else:
            self.compress_weight_k = self.compress_weight_v = None

    def new_cache(self, batch_size: int, max_seq_len: int | None = None) -> NSACache:
        """An empty cache for chunk-by-chunk decoding of ``[batch_size, chunk, hidden]`` inputs."""
        return NSACache(check_int("batch_size", batch_size, lo=1), max_seq_len)

    def _attend(self, q, k, v, g, layout, cu):
        return native_sparse_attention(q, k, v, g, self.compress_weight_k, self.compress_weight_v, layout=layout,
                                       cu_seqlens=cu, **self.config)

    def forward(self, x: Tensor, cu_seqlens=None, cache: NSACache | None = None) -> Tensor:
        """``x [B, T, hidden]`` (each row a sequence) or packed ``[T, hidden]`` with ``cu_seqlens`` (leading 0).
        With ``cache`` (``[B, T, hidden]`` only), ``x`` continues the cached sequences; the output equals the
        full forward's on these tokens."""
        check_tensor("x", x)
        if x.ndim == 2:
            require(cache is None, "cache", "None for packed input (use [B, T, hidden])", "a cache")
            cum = cumulative_from_cu_seqlens("cu_seqlens", cu_seqlens) if cu_seqlens is not None else [x.shape[0]]
            lengths = lengths_from_cumulative("cu_seqlens", cum, x.shape[0])
            pos = torch.cat([torch.arange(n, device=x.device) for n in lengths])
            q, k, v, g = self._project(x, pos)
            out = self._attend(q, k, v, g, "TND", torch.tensor([0, *cum]))
            return self.o_proj(out.flatten(-2))
        if x.ndim != 3:
            fail("x", "[B, T, hidden] or packed [T, hidden]", x)
        require(cu_seqlens is None, "cu_seqlens", "None for [B, T, hidden] input", cu_seqlens)
        b, t = x.shape[:2]
        past = 0 if cache is None else cache.seq_len
        pos = torch.arange(past, past + t, device=x.device).repeat(b)
        q, k, v, g = (y.unflatten(0, (b, t)) for y in self._project(x.flatten(0, 1), pos))
        if cache is not None:
            k, v = cache.append(k, v)
            if past:  # earlier queries do not change later outputs (causal): zero placeholders, outputs dropped
                q = torch.cat([q.new_zeros(b, past, *q.shape[2:]), q], 1)
                g = torch.cat([g.new_zeros(b, past, *g.shape[2:]), g], 1)
        out = self._attend(q, k, v, g, "BSND", None)[:, past:]
        return self.o_proj(out.flatten(-2))

    def _project(self, x: Tensor, pos: Tensor):
        """``x [T, hidden]`` -> rotated q ``[T, N1, D]``, rotated k, v ``[T, N2, D]`` and gates ``[T, N1, 3]``."""
        q = apply_rotary(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)), pos, self.rope_theta)
        k = apply_rotary(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)), pos, self.rope_theta)
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        g = torch.sigmoid(self.g_proj(x)).unflatten(-1, (self.num_heads, 3))
        return q, k, v, g
