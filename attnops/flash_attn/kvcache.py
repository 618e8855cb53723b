"""``flash_attn_with_kvcache``: flash-attn 2's decode/append call on attnops' FusedInferAttention core.

The call runs in three steps, each on the device with no value read back on a GPU: new keys (rotated) and values are
written into the cache in place at ``cache_seqlens``; the query is rotated; FusedInferAttention attends over each
batch's first ``cache_seqlens + seqlen_new`` cache tokens (the paged cache read in place through ``block_table``),
with the masks that flash-attn's options imply built as one boolean tensor where its own sparse modes cannot say
them (left padding, sliding windows) and ALiBi as its ``pse_shift``. Softcapping, which FusedInferAttention lacks,
runs on the FlashAttention core over a dense copy of the batch's cache with the same mask.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.checks import Described, check_int, check_scale, check_tensor, require
from .._core.indices import check_block_table, valid_ids, validation_enabled
from ..ops.flash_attention import flash_attention
from ..ops.fused_infer_attention import fused_infer_attention
from .errors import flash_attn_errors
from .ops.triton.rotary import rotate
from .outputs import softmax_lse
from .window import as_pair

__all__ = ["flash_attn_with_kvcache", "padded_queries", "packed_rows", "with_kvcache"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int32, torch.int64)


@flash_attn_errors
def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = None,
                            v: Tensor | None = None, rotary_cos: Tensor | None = None,
                            rotary_sin: Tensor | None = None, cache_seqlens: int | Tensor | None = None,
                            cache_batch_idx: Tensor | None = None, cache_leftpad: Tensor | None = None,
                            block_table: Tensor | None = None, softmax_scale: float | None = None,
                            causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Tensor | None = None,
                            num_splits: int = 0, return_softmax_lse: bool = False):
    """flash-attn's ``flash_attn_with_kvcache``: attention of ``q`` over a KV cache, after appending ``k``/``v``.

    Shapes: ``q`` ``[B, Sq, H, D]``; ``k_cache``/``v_cache`` ``[B_c, S_c, H_k, D]`` (``H % H_k == 0``), or with
    ``block_table`` (int32 ``[B, max_blocks]``) a paged cache ``[num_blocks, page, H_k, D]`` (any page size);
    ``v_cache`` may have its own head dim Dv. ``k``/``v`` ``[B, S_new, H_k, D]`` are written in place into the cache
    at positions ``cache_seqlens[b] + s`` (the cache must have room: on the CPU this is checked).
    ``cache_seqlens``: an int or an int32 ``[B]`` tensor, the tokens already in the cache (default: the whole
    cache, without ``k``/``v``); batch ``b`` attends to cache tokens ``[cache_leftpad[b], cache_seqlens[b] +
    S_new)``. ``cache_batch_idx`` ``[B]``: the cache rows of the batches (contiguous caches). ``cache_leftpad``
    ``[B]``: the first valid token of each row (contiguous caches); positions stay absolute.
    ``softcap`` > 0 caps the scaled scores at ``softcap * tanh(S / softcap)`` (before ALiBi and the masks).
    Rotary (with ``k``/``v``): ``rotary_cos``/``rotary_sin`` ``[seqlen_ro, rotary_dim / 2]`` (``seqlen_ro`` at
    least the cache capacity) rotate the first ``rotary_dim`` values of ``k`` at ``cache_seqlens + s`` and of ``q``
    at ``cache_seqlens + s`` when causal or local, else at ``cache_seqlens``; ``rotary_interleaved`` pairs ``2i``
    with ``2i + 1`` (else ``i`` with ``i + rotary_dim / 2``).
    ``softmax_scale`` defaults to ``D**-0.5``. ``causal`` and ``window_size=(left, right)`` (-1 unbounded) keep
    key ``j`` for query ``i`` iff ``i + L - Sq - left <= j <= i + L - Sq + right`` (``right = 0`` when causal),
    ``L = cache_seqlens + S_new``: aligned to the bottom right of each batch's valid keys. ``alibi_slopes`` fp32
    ``[H]`` or ``[B, H]`` add ``-slope * |i + L - Sq - j|`` to the scaled scores. ``num_splits`` is accepted and
    has no effect. Rows that see no key give 0 (and lse +inf). Inference only (no backward), as flash-attn.

    Returns ``out`` ``[B, Sq, H, Dv]``, or ``(out, softmax_lse)`` with fp32 ``softmax_lse`` ``[B, H, Sq]`` when
    ``return_softmax_lse``.

    Example::

        >>> k_cache, v_cache = torch.zeros(2, 64, 2, 16), torch.zeros(2, 64, 2, 16)
        >>> lens = torch.tensor([10, 3], dtype=torch.int32)
        >>> out = flash_attn_with_kvcache(torch.randn(2, 1, 4, 16), k_cache, v_cache, torch.randn(2, 1, 2, 16),
        ...                               torch.randn(2, 1, 2, 16), cache_seqlens=lens, causal=True)
        >>> out.shape  # the new token was written at positions 10 and 3 of the two cache rows
        torch.Size([2, 1, 4, 16])
    """
    require(block_table is None or cache_leftpad is None, "cache_leftpad", "None with a paged cache (block_table)",
            cache_leftpad)
    return with_kvcache(**locals(), q_lens=None)


def with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                 block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                 return_softmax_lse, q_lens: Tensor | None, cu_seqlens_k_new: Tensor | None = None,
                 rotary_seqlens: Tensor | None = None, attention_chunk: int = 0, qv: Tensor | None = None):
    """:func:`flash_attn_with_kvcache`'s body, with FlashAttention-3's additions. ``q_lens`` (int64 ``[B]``, on q's
    device): the query rows of each batch of a padded ``q`` (varlen queries), each batch aligned to its own
    bottom-right corner; None: all ``Sq`` rows. ``cu_seqlens_k_new`` (int32 ``[B + 1]``): ``k``/``v`` are packed
    ``[T_new, H_k, D]``, batch ``b`` appending its tokens ``cu[b]:cu[b + 1]``. ``rotary_seqlens`` (int ``[B]``):
    the rotary positions of the first new token (default ``cache_seqlens``). ``attention_chunk`` > 0: each row sees
    only the keys of its chunk (counted from the left padding's end). ``qv`` ``[B, Sq, H, Dv]``: scores
    ``q.k + qv.v``, as one product of ``[q, qv]`` and a ``[k, v]`` copy of the cache."""
    batch, sq, heads, _ = check_tensor("q", q, ndim=4, dtypes=_FLOATS).shape
    capacity = _check_cache(q, k_cache, v_cache, block_table, cache_batch_idx, cache_leftpad)
    left, right = _window(causal, window_size)
    ok = isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and softcap >= 0
    require(ok, "softcap", "a float >= 0 (0.0: no softcapping)", softcap)
    if softmax_scale is not None:
        check_scale("softmax_scale", softmax_scale)
    check_int("num_splits", num_splits, lo=0)
    _check_alibi(alibi_slopes, q)
    seqlens = _seqlens(cache_seqlens, batch, q.device)
    chunk = check_int("attention_chunk", attention_chunk, lo=0)
    new = 0 if k is None and v is None else _check_new_kv(q, k_cache, v_cache, k, v, seqlens, cu_seqlens_k_new)
    tables = None
    if rotary_cos is not None or rotary_sin is not None:
        require(k is not None, "rotary_cos", "None without k and v (rotary embedding rotates the appended keys)",
                rotary_cos)
        tables = _rotary_tables(k_cache, rotary_cos, rotary_sin, capacity)
    lengths = None if seqlens is None else seqlens + new
    if lengths is not None and lengths.device.type == "cpu" and not torch.compiler.is_compiling():
        _check_lengths(lengths, cache_leftpad, capacity, block_table, k_cache.shape[0])
    if k is not None:
        rotary_at = seqlens if rotary_seqlens is None else _seqlens(rotary_seqlens, batch, q.device, "rotary_seqlens")
        q = _append(q, k_cache, v_cache, k, v, seqlens, tables, rotary_interleaved, causal or (left, right) != (-1, -1),
                    block_table, cache_batch_idx, cu_seqlens_k_new, rotary_at)
    if qv is not None:
        check_tensor("qv", qv, shape=(*q.shape[:-1], v_cache.shape[-1]), dtypes=(q.dtype,))
        q, k_cache = torch.cat([q, qv], -1), torch.cat([k_cache, v_cache], -1)
    ends = torch.full((batch,), capacity, device=q.device) if lengths is None else lengths.long()
    shift = ends - (sq if q_lens is None else q_lens)  # the key column of query row 0's bottom-right diagonal
    pse = None if alibi_slopes is None else _alibi_bias(alibi_slopes, shift, batch, heads, sq, capacity, q.dtype)
    if softcap > 0:
        out, lse = _softcapped_attention(q, k_cache, v_cache, block_table, cache_batch_idx, softmax_scale, softcap,
                                         _mask(ends, shift, cache_leftpad, sq, capacity, left, right, chunk), pse)
    else:
        native_causal = causal and left < 0 and q_lens is None and cache_leftpad is None and not chunk  # FIA's band
        mask = None
        if cache_leftpad is not None or chunk or (left, right) != (-1, -1) and not native_causal:
            mask = _mask(ends, shift, cache_leftpad, sq, capacity, left, right, chunk)
        key, value = _cache_views(k_cache, v_cache, block_table, cache_batch_idx, batch)
        out, lse = fused_infer_attention(q, key, value, layout="BSND", num_key_value_heads=key.shape[-2],
                                         scale=softmax_scale, causal=native_causal, atten_mask=mask,
                                         pse_shift=pse, actual_seq_lengths_kv=lengths, block_table=block_table,
                                         return_lse=True)
        lse = lse.squeeze(-1)
    return (out, lse) if return_softmax_lse else out


def _append(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, seqlens: Tensor, tables,
            interleaved: bool, local: bool, block_table, cache_batch_idx, cu_seqlens_k_new, rotary_at: Tensor) -> Tensor:
    """Write ``k`` (rotated by ``tables``) and ``v`` into the caches at ``seqlens + s``; returns ``q``, rotated at
    ``rotary_at + s`` when ``local`` (causal or windowed), else at ``rotary_at``, when there are tables (the keys at
    ``rotary_at + s``). Packed ``k``/``v`` (``cu_seqlens_k_new``) are written token by token: each token a row of
    its own batch's tables."""
    if cu_seqlens_k_new is not None:
        cu = cu_seqlens_k_new.long()
        tokens = torch.arange(k.shape[0], device=k.device)
        owner = torch.searchsorted(cu[1:], tokens, right=True).clamp_(max=cu.shape[0] - 2)
        steps = (tokens - cu[owner]).unsqueeze(1)
        k, v, seqlens, key_rotary_at = k.unsqueeze(1), v.unsqueeze(1), seqlens[owner], rotary_at[owner]
        rows = owner if cache_batch_idx is None else cache_batch_idx.long()[owner]
        block_table = None if block_table is None else block_table[owner]
    else:
        steps = torch.arange(k.shape[1], device=k.device).unsqueeze(0)
        rows = torch.arange(k.shape[0], device=k.device) if cache_batch_idx is None else cache_batch_idx.long()
        key_rotary_at = rotary_at
    positions = seqlens.unsqueeze(1) + steps
    if tables is not None:
        k = rotate(k, *tables, (key_rotary_at.unsqueeze(1) + steps).expand(k.shape[:2]), interleaved)
        q_positions = rotary_at.unsqueeze(1) + torch.arange(q.shape[1], device=q.device) if local else rotary_at[:, None]
        q = rotate(q, *tables, q_positions.expand(q.shape[0], q.shape[1]), interleaved)
    if block_table is None:
        index = (rows.unsqueeze(1).expand_as(positions), positions.expand(k.shape[:2]))
    else:
        index, k, v = _paged_writes(k_cache, v_cache, k, v, block_table, positions.expand(k.shape[:2]))
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)
    return q


def _paged_writes(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, block_table: Tensor, positions: Tensor):
    """``(index, k, v)`` of the appends through ``block_table``: a token whose page id is outside the cache (an
    unvalidated table) writes nothing. Without a host read: its write is redirected to the first valid token's slot
    with that token's rows (or, when no token is valid, to a slot with the rows already there), so every duplicate
    writes equal values."""
    page, num_blocks = k_cache.shape[1], k_cache.shape[0]
    blocks = block_table.long().gather(1, positions // page)
    offsets = positions % page
    valid = valid_ids(blocks, num_blocks)
    first = valid.flatten().to(torch.uint8).argmax().view(1)  # 0 when no token is valid (a device tensor)
    block0 = blocks.flatten().index_select(0, first).clamp(0, num_blocks - 1)
    offset0 = offsets.flatten().index_select(0, first)
    index = (torch.where(valid, blocks, block0), torch.where(valid, offsets, offset0))
    any_valid = valid.any()
    keep = valid[..., None, None]

    def rows(new: Tensor, cache: Tensor) -> Tensor:
        stand_in = torch.where(any_valid, new.flatten(0, 1).index_select(0, first), cache[block0, offset0])
        return torch.where(keep, new, stand_in.to(new.dtype))

    return index, rows(k, k_cache), rows(v, v_cache)


def _softcapped_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table, cache_batch_idx, scale, softcap,
                          mask: Tensor, pse) -> tuple[Tensor, Tensor]:
    """Softcapping, which FusedInferAttention lacks, on the FlashAttention core: each batch's cache as a dense
    ``[B, capacity, H_k, D]`` copy (paged: its pages in order), the lengths, left padding and window in ``mask``,
    ALiBi as a pse added after the cap; ``(out, lse [B, H, Sq])``."""
    if block_table is None:
        key, value = _cache_views(k_cache, v_cache, None, cache_batch_idx, q.shape[0])
    else:
        key, value = (c[block_table.long()].flatten(1, 2) for c in (k_cache, v_cache))
    result = flash_attention(q, key, value, layout="BSND", scale=scale, softcap=float(softcap), atten_mask=mask,
                             pse=pse, pse_type=0, return_stats=True)
    return result.out, softmax_lse(result, False)


def _check_cache(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table, cache_batch_idx, cache_leftpad) -> int:
    """Validate the caches and their indexing arguments; returns the capacity in tokens of one sequence."""
    batch, _, heads, d = q.shape
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype,))
    h_k = k_cache.shape[2]
    require(k_cache.shape[3] == d and h_k > 0 and heads % h_k == 0, "k_cache",
            f"[*, *, H_k, D={d}] with H={heads} a multiple of H_k", k_cache)
    check_tensor("v_cache", v_cache, shape=(*k_cache.shape[:3], None), dtypes=(q.dtype,))
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table),
                    ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        require(x is None or x.device == q.device, name, f"a tensor on {q.device} (the device of q)", x)
    if block_table is not None:
        check_tensor("block_table", block_table, ndim=2, dtypes=_INTS)
        require(block_table.shape[0] == batch, "block_table", f"[B={batch}, max_blocks]", block_table)
        require(cache_batch_idx is None, "cache_batch_idx", "None with a paged cache (block_table)", cache_batch_idx)
        return block_table.shape[1] * k_cache.shape[1]
    if cache_batch_idx is None:
        require(k_cache.shape[0] >= batch, "k_cache", f"[B_c >= {batch}, S_c, H_k, D] (a row per batch of q)",
                k_cache)
    else:
        check_tensor("cache_batch_idx", cache_batch_idx, shape=(batch,), dtypes=_INTS)
        if cache_batch_idx.device.type == "cpu" and not torch.compiler.is_compiling():
            require(bool(((cache_batch_idx >= 0) & (cache_batch_idx < k_cache.shape[0])).all()), "cache_batch_idx",
                    f"rows of the cache in [0, {k_cache.shape[0]})", cache_batch_idx.tolist())
    if cache_leftpad is not None:
        check_tensor("cache_leftpad", cache_leftpad, shape=(batch,), dtypes=_INTS)
    return k_cache.shape[1]


def _window(causal, window_size) -> tuple[int, int]:
    """``(left, right)`` with -1 for unbounded and ``right = 0`` when causal (flash-attn's normal form)."""
    require(isinstance(causal, bool), "causal", "a bool", causal)
    window_size = as_pair(window_size)
    ok = (isinstance(window_size, (tuple, list)) and len(window_size) == 2
          and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size))
    require(ok, "window_size", "a pair (left, right) of ints >= -1 (-1: unbounded)", window_size)
    return window_size[0], 0 if causal else window_size[1]


def _seqlens(cache_seqlens, batch: int, device: torch.device, name: str = "cache_seqlens") -> Tensor | None:
    """``cache_seqlens`` (or another per-batch position, ``name``) as int64 ``[B]`` on ``device`` (None: the whole
    cache)."""
    if cache_seqlens is None:
        return None
    if isinstance(cache_seqlens, Tensor):
        check_tensor(name, cache_seqlens, shape=(batch,), dtypes=_INTS)
        require(cache_seqlens.device == device, name, f"a tensor on {device} (the device of q)", cache_seqlens)
        return cache_seqlens.long()
    return torch.full((batch,), check_int(name, cache_seqlens, lo=0), dtype=torch.int64, device=device)


def _check_new_kv(q: Tensor, k_cache: Tensor, v_cache: Tensor, k, v, seqlens, cu_seqlens_k_new):
    """Validate ``k``/``v`` ``[B, S_new, H_k, D]``, or packed ``[T_new, H_k, D]`` with int32 ``cu_seqlens_k_new``
    ``[B + 1]``; returns ``S_new``, or the per-batch new lengths (int64 ``[B]``) of packed ones."""
    require(k is not None and v is not None, "k" if k is None else "v", "k and v together (or neither)", None)
    require(seqlens is not None, "cache_seqlens", "the cache lengths at which k and v are appended", None)
    require(k.device == q.device and v.device == q.device, "k", f"k and v on {q.device} (the device of q)", k)
    if cu_seqlens_k_new is None:
        check_tensor("k", k, shape=(q.shape[0], None, *k_cache.shape[2:]), dtypes=(q.dtype,))
        check_tensor("v", v, shape=(*k.shape[:2], *v_cache.shape[2:]), dtypes=(q.dtype,))
        return k.shape[1]
    check_tensor("k", k, shape=(None, *k_cache.shape[2:]), dtypes=(q.dtype,))
    check_tensor("v", v, shape=(k.shape[0], *v_cache.shape[2:]), dtypes=(q.dtype,))
    check_tensor("cu_seqlens_k_new", cu_seqlens_k_new, shape=(q.shape[0] + 1,), dtypes=_INTS)
    require(cu_seqlens_k_new.device == q.device, "cu_seqlens_k_new", f"a tensor on {q.device}", cu_seqlens_k_new)
    cu = cu_seqlens_k_new.long()
    if cu.device.type == "cpu" and not torch.compiler.is_compiling():
        require(int(cu[0]) == 0 and int(cu[-1]) == k.shape[0] and bool((cu[1:] >= cu[:-1]).all()), "cu_seqlens_k_new",
                f"prefix sums from 0 to T_new={k.shape[0]}", cu_seqlens_k_new.tolist())
    return cu[1:] - cu[:-1]


def _rotary_tables(k_cache: Tensor, cos, sin, capacity: int) -> tuple[Tensor, Tensor]:
    """Validate ``rotary_cos``/``rotary_sin`` ``[seqlen_ro >= capacity, rotary_dim / 2]``."""
    check_tensor("rotary_cos", cos, ndim=2, dtypes=_FLOATS)
    check_tensor("rotary_sin", sin, shape=tuple(cos.shape), dtypes=(cos.dtype,))
    require(cos.shape[0] >= capacity and 0 < 2 * cos.shape[1] <= k_cache.shape[-1], "rotary_cos",
            f"[seqlen_ro >= {capacity} (the cache's capacity), rotary_dim / 2] with rotary_dim <= "
            f"{k_cache.shape[-1]}", cos)
    require(cos.device == k_cache.device and sin.device == k_cache.device, "rotary_cos",
            f"rotary_cos/rotary_sin on {k_cache.device}", cos)
    return cos, sin


def _check_lengths(lengths: Tensor, cache_leftpad, capacity: int, block_table, num_blocks: int) -> None:
    """Host checks of CPU lengths, before anything is written: ``0 <= cache_leftpad <= cache_seqlens + S_new <=
    capacity``, and the pages a sequence uses are pages of the cache."""
    where = ("the cache's capacity" if block_table is None else
             f"the cache's capacity: block_table's {block_table.shape[1]} columns of {capacity // block_table.shape[1]}"
             f"-token pages")
    require(bool(((lengths >= 0) & (lengths <= capacity)).all()), "cache_seqlens",
            f"cache_seqlens + seqlen_new in [0, {capacity}] ({where})", Described(f"ends {lengths.tolist()}"))
    if cache_leftpad is not None:
        require(bool(((cache_leftpad >= 0) & (cache_leftpad <= lengths)).all()), "cache_leftpad",
                "values in [0, cache_seqlens + seqlen_new]", cache_leftpad.tolist())
    if block_table is not None and validation_enabled(block_table.device):
        check_block_table(block_table, lengths, capacity // block_table.shape[1], num_blocks,
                          lengths_name="cache_seqlens + seqlen_new")


def _cache_views(k_cache: Tensor, v_cache: Tensor, block_table, cache_batch_idx, batch: int):
    """The key/value tensors FusedInferAttention reads: the paged cache as it is, the rows of a contiguous one."""
    if block_table is not None:
        return k_cache, v_cache
    if cache_batch_idx is None:
        return k_cache[:batch], v_cache[:batch]
    return k_cache.index_select(0, cache_batch_idx.long()), v_cache.index_select(0, cache_batch_idx.long())


def _offsets(shift: Tensor, sq: int, capacity: int) -> Tensor:
    """``j - (i + shift)`` as int64 ``[B, 1, Sq, capacity]``: a key's distance from the bottom-right diagonal
    (``shift = L - Sq`` per batch)."""
    i = torch.arange(sq, device=shift.device).view(1, 1, sq, 1)
    j = torch.arange(capacity, device=shift.device).view(1, 1, 1, capacity)
    return j - i - shift.view(-1, 1, 1, 1)


def _mask(ends: Tensor, shift: Tensor, cache_leftpad, sq: int, capacity: int, left: int, right: int,
          chunk: int = 0) -> Tensor:
    """Bool ``[B, 1, Sq, capacity]`` (True = masked): keys at or past each batch's length ``ends``, outside the
    window band around the diagonal ``j = i + shift``, before the left padding's end, or (``chunk`` > 0) outside
    the row's chunk ``[p - p % chunk, p - p % chunk + chunk)`` of ``p = i + shift``, counted from the left padding's
    end."""
    offset = _offsets(shift, sq, capacity)
    j = torch.arange(capacity, device=ends.device)
    masked = (j >= ends.view(-1, 1)).view(-1, 1, 1, capacity) | (offset > right if right >= 0 else False)
    if left >= 0:
        masked = masked | (offset < -left)
    if cache_leftpad is not None:
        masked = masked | (j < cache_leftpad.long().view(-1, 1)).view(-1, 1, 1, capacity)
    if chunk:
        pad = 0 if cache_leftpad is None else cache_leftpad.long().view(-1, 1, 1, 1)
        p = torch.arange(sq, device=ends.device).view(1, 1, sq, 1) + shift.view(-1, 1, 1, 1) - pad
        start = p - p.remainder(chunk)
        masked = masked | ((j - pad) < start) | ((j - pad) >= start + chunk)
    return masked.expand(-1, 1, sq, capacity).contiguous()


def _check_alibi(slopes, q: Tensor) -> None:
    """``alibi_slopes``: None or fp32 ``[H]`` / ``[B, H]`` on q's device."""
    if slopes is None:
        return
    batch, _, heads, _ = q.shape
    check_tensor("alibi_slopes", slopes, dtypes=(torch.float32,))
    require(tuple(slopes.shape) in ((heads,), (batch, heads)), "alibi_slopes", f"[H={heads}] or [B={batch}, "
            f"H={heads}]", slopes)
    require(slopes.device == q.device, "alibi_slopes", f"a tensor on {q.device} (the device of q)", slopes)


def _alibi_bias(slopes, shift: Tensor, batch: int, heads: int, sq: int, capacity: int, dtype) -> Tensor:
    """``-slope * |i + shift - j|`` (``shift = L - Sq``) as ``[B, H, Sq, capacity]`` in ``dtype`` (FusedInferAttention's
    pse_shift)."""
    distance = _offsets(shift, sq, capacity).abs().to(torch.float32)
    return (-slopes.expand(batch, heads).view(batch, heads, 1, 1) * distance).to(dtype)


def padded_queries(q: Tensor, cu_seqlens_q, max_seqlen_q) -> tuple[Tensor, Tensor]:
    """Varlen queries ``[T, H, D]`` with int32 ``cu_seqlens_q`` ``[B + 1]`` (leading 0) as ``[B, max_seqlen_q, H, D]``
    (rows past a batch's length repeat a valid token and are ignored) and the per-batch lengths (int64 ``[B]``), by
    device indexing; CPU lengths are checked."""
    check_tensor("q", q, ndim=3, dtypes=_FLOATS)
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=_INTS)
    require(cu_seqlens_q.shape[0] >= 2 and cu_seqlens_q.device == q.device, "cu_seqlens_q",
            f"[B + 1] (B >= 1) on {q.device} (the device of q)", cu_seqlens_q)
    max_len = check_int("max_seqlen_q", max_seqlen_q, lo=1)
    cu = cu_seqlens_q.long()
    lens = cu[1:] - cu[:-1]
    if cu.device.type == "cpu" and not torch.compiler.is_compiling():
        ok = int(cu[0]) == 0 and int(cu[-1]) == q.shape[0] and bool(((lens >= 0) & (lens <= max_len)).all())
        require(ok, "cu_seqlens_q", f"prefix sums from 0 to T={q.shape[0]} with lengths <= max_seqlen_q={max_len}",
                cu_seqlens_q.tolist())
    rows = (cu[:-1].unsqueeze(1) + torch.arange(max_len, device=q.device)).clamp(max=max(q.shape[0] - 1, 0))
    return q[rows], lens


def packed_rows(x: Tensor, cu_seqlens_q: Tensor, total: int) -> Tensor:
    """The inverse of :func:`padded_queries` for per-row results ``x`` ``[B, max_seqlen_q, ...]``: ``[total, ...]``,
    token ``t`` of batch ``b`` from row ``t - cu_seqlens_q[b]``."""
    cu = cu_seqlens_q.long()
    tokens = torch.arange(total, device=x.device)
    batch = torch.searchsorted(cu[1:], tokens, right=True).clamp_(max=cu.shape[0] - 2)
    return x[batch, (tokens - cu[batch]).clamp(0, x.shape[1] - 1)]
