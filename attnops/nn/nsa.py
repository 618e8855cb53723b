"""``NativeSparseAttention``: an NSA attention layer (projections, RoPE, three branches, output projection)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .._core.checks import Described, check_int, check_scale, fail, int_list, require
from .._core.errors import ParamDtypeError
from ..ops.nsa.compress_attention import check_block_sizes
from ..ops.nsa.layer import COMPRESS_MODES
from ..ops.nsa.layer_op import native_sparse_attention
from .layer_input import check_layer_input
from .nsa_cache import NSACache
from .nsa_decode import cached_sparse_attention, compress_new, compress_pending
from .nsa_step import decode_step
from .rotary import apply_rotary, rotary_angles


class NativeSparseAttention(nn.Module):
    """Native Sparse Attention layer (DeepSeek, arXiv 2502.11089) over :func:`attnops.native_sparse_attention`.

    ``x -> q, k, v`` (linear, no bias), RoPE on q and k (``rope_theta``, rotate-half), per-head sigmoid gates
    ``[.., N1, 3]`` (compression, selection, window) from a linear projection of ``x``, the three branches, then the
    output projection. Keys are compressed **after** RoPE (each key rotated at its own position, then pooled);
    values carry no rotation. ``compress="weighted"`` learns ``compress_weight_k/v [compress_block_size,
    num_kv_heads]`` (initialised to the mean); ``"mean"`` has no compression weights. ``local_blocks``: block 0
    and that many blocks ending at the token's own one are always selected. Positions restart at 0 for each
    sequence. Decoding: :meth:`new_cache` (one cache per layer: the cache is bound to this layer and its settings,
    another layer raises), then ``forward(x, cache=cache)`` chunk by chunk. Settings are checked at construction
    and ``x``/``cu_seqlens`` at every call.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 compress_block_size: int = 32, compress_stride: int = 16, select_block_size: int = 64,
                 select_block_count: int = 16, window_size: int = 512, local_blocks: int = 2,
                 rope_theta: float = 10000.0, compress: str = "weighted"):
        super().__init__()
        self.hidden_size = check_int("hidden_size", hidden_size, lo=1)
        n1 = check_int("num_heads", num_heads, lo=1)
        n2 = check_int("num_kv_heads", num_kv_heads, lo=1)
        require(n1 % n2 == 0, "num_kv_heads", f"a divisor of num_heads={n1}", n2)
        d = check_int("head_dim", head_dim, lo=2)
        require(d % 2 == 0, "head_dim", "an even number (RoPE)", d)
        require(compress in COMPRESS_MODES, "compress", f"one of {COMPRESS_MODES}", compress)
        compress_block_size, compress_stride, select_block_size, select_block_count = check_block_sizes(
            compress_block_size, compress_stride, select_block_size, select_block_count)
        self.num_heads, self.num_kv_heads, self.head_dim = n1, n2, d
        self.config = dict(compress_block_size=compress_block_size, compress_stride=compress_stride,
                           select_block_size=select_block_size, select_block_count=select_block_count,
                           window_size=check_int("window_size", window_size, lo=0),
                           local_blocks=check_int("local_blocks", local_blocks, lo=0), compress=compress)
        theta = check_scale("rope_theta", rope_theta)
        require(theta > 0, "rope_theta", "a positive float", theta)
        self.rope_theta = theta
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

    def new_cache(self, batch_size: int, max_seq_len: int | None = None, *, page_size: int | None = None
                  ) -> NSACache:
        """An empty cache for decoding ``[batch_size, chunk, hidden]`` inputs chunk by chunk (the rows advance
        together); ``max_seq_len`` allocates every page at the first call; pages of ``page_size`` tokens (default:
        ``select_block_size``). The cache belongs to this layer (:meth:`NSACache.bind`): use one per layer."""
        cfg = self.config
        cache = NSACache(batch_size, compress_block_size=cfg["compress_block_size"],
                         compress_stride=cfg["compress_stride"],
                         page_size=cfg["select_block_size"] if page_size is None else page_size,
                         max_seq_len=max_seq_len, select_block_size=cfg["select_block_size"],
                         select_block_count=cfg["select_block_count"])
        cache.bind(self, self._settings())
        return cache

    def _settings(self) -> dict:
        """What a cache of this layer depends on: the head counts and dims and the branches' settings."""
        return dict(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, **self.config)

    def _attend(self, q, k, v, g, layout, cu):
        return native_sparse_attention(q, k, v, g, self.compress_weight_k, self.compress_weight_v, layout=layout,
                                       cu_seqlens=cu, **self.config)

    def forward(self, x: Tensor, cu_seqlens=None, cache: NSACache | None = None) -> Tensor:
        """``x [B, T, hidden]`` (each row a sequence) or packed ``[T, hidden]`` with ``cu_seqlens`` (leading 0).
        With ``cache`` (``[B, T, hidden]`` only, from :meth:`new_cache`), ``x`` continues the cached sequences
        (any chunk length, e.g. a prefill then one token per call) and is appended to the cache; the output equals
        the full forward's on these tokens, at a cost linear in the chunk and the attended keys (see
        :mod:`attnops.nn.nsa_decode`). Cached calls are inference only: they must run under ``torch.no_grad()``
        or ``torch.inference_mode()``."""
        check_layer_input(x, self.q_proj.weight, self.hidden_size, packed=True, empty_steps=cache is not None)
        if x.ndim == 2:
            require(cache is None, "cache", "None for packed input (use [B, T, hidden])", Described("a cache"))
            cu = _packed_offsets(cu_seqlens, x.shape[0])
            pos = torch.cat([torch.arange(end - start, device=x.device) for start, end in zip(cu, cu[1:])])
            q, k, v, g = self._project(x, pos)
            out = self._attend(q, k, v, g, "TND", cu)
            return self.o_proj(out.flatten(-2))
        require(cu_seqlens is None, "cu_seqlens", "None for [B, T, hidden] input", cu_seqlens)
        if cache is not None:
            if not isinstance(cache, NSACache):
                fail("cache", "an NSACache from layer.new_cache(batch_size)", Described(type(cache).__name__),
                     error=ParamDtypeError)
            cache.bind(self, self._settings())
        b, t = x.shape[:2]
        if cache is not None:
            require(not torch.is_grad_enabled(), "cache", "calls under torch.no_grad() or torch.inference_mode() "
                    "(decoding has no backward)", Described("grad mode enabled"))
            require(x.shape[0] == cache.batch_size, "x", f"a batch of {cache.batch_size} (the cache's)", x.shape[0])
        if t == 0:  # no new tokens: an empty output, the cache unchanged
            return self.o_proj(x.new_zeros(b, 0, self.num_heads * self.head_dim))
        if cache is not None and cache.seq_len > 0:
            return self.o_proj(self._continue(x, cache).flatten(-2))
        pos = torch.arange(t, device=x.device).expand(b, t) if cache is None else cache.positions(t, x.device)
        q, k, v, g = (y.unflatten(0, (b, t)) for y in self._project(x.flatten(0, 1), pos.flatten()))
        out = self._attend(q, k, v, g, "BSND", None)  # the whole sequence so far: the layer itself
        if cache is not None:
            cache.append(k, v)
            compress_pending(cache, self.config["compress"], self.compress_weight_k, self.compress_weight_v)
        return self.o_proj(out.flatten(-2))

    def _continue(self, x: Tensor, cache: NSACache) -> Tensor:
        """The cached path for tokens that continue ``cache``: their positions and every index they need looked up
        (:func:`~attnops.nn.nsa_step.decode_step`), RoPE from the table of the cache's capacity, the keys stored,
        the completed blocks compressed, the three branches -> ``[B, t, N1, Dv]``."""
        b, t = x.shape[:2]
        cfg = {name: value for name, value in self.config.items() if name != "compress"}
        flat = x.flatten(0, 1)
        step, qk = decode_step(cache, self.q_proj(flat).unflatten(-1, (self.num_heads, self.head_dim)),
                               self.k_proj(flat).unflatten(-1, (self.num_kv_heads, self.head_dim)),
                               window=cfg["window_size"], local_blocks=cfg["local_blocks"], theta=self.rope_theta)
        q, k = (y.unflatten(0, (b, t)) for y in (qk[:, :self.num_heads], qk[:, self.num_heads:]))
        v, g = (y.unflatten(0, (b, t)) for y in self._value_and_gates(flat))
        cache.store(k, v, step.slots)
        weights = (self.config["compress"], self.compress_weight_k, self.compress_weight_v)
        if t == 1:  # a decoding step: compressed on the device from the cache's lengths (capturable)
            compress_new(cache, step, *weights)
        else:  # a chunk: its completed blocks at once (host-known lengths)
            compress_pending(cache, *weights)
        return cached_sparse_attention(cache, q, g, step, **cfg)

    def _project(self, x: Tensor, pos: Tensor):
        """``x [T, hidden]`` -> q ``[T, N1, D]`` and k rotated at positions ``pos [T]`` (at once), v ``[T, N2, D]``
        and gates ``[T, N1, 3]``."""
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        qk = torch.cat([q, k], -2)
        qk = apply_rotary(qk, *rotary_angles(pos, self.head_dim, self.rope_theta, qk.dtype))
        return (qk[:, :self.num_heads], qk[:, self.num_heads:], *self._value_and_gates(x))

    def _value_and_gates(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x [T, hidden]`` -> v ``[T, N2, D]`` and the gates ``[T, N1, 3]``."""
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        g = torch.sigmoid(self.g_proj(x)).unflatten(-1, (self.num_heads, 3))
        return v, g


def _packed_offsets(cu_seqlens, tokens: int) -> list[int]:
    """``cu_seqlens`` (list or integer tensor, read on the host: the positions need the lengths) as a list
    ``[0, end of sequence 1, ..., tokens]``, non-decreasing; None: one sequence."""
    if cu_seqlens is None:
        return [0, tokens]
    cu = int_list("cu_seqlens", cu_seqlens)
    require(len(cu) >= 2 and cu[0] == 0, "cu_seqlens", "the offsets [0, end of sequence 1, ..., T]: a leading 0 and "
            "B + 1 entries", cu)
    require(all(a <= b for a, b in zip(cu, cu[1:])), "cu_seqlens", "non-decreasing offsets", cu)
    require(cu[-1] == tokens, "cu_seqlens", f"a last offset equal to x's token count T={tokens}", cu,
            "the sequences must cover every token of x")
    return cu
