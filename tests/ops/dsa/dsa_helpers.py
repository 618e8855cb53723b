"""Per-batch DSA inputs and their packing into the ops' layouts (BSND / TND queries, BSND / TND / PA_BSND keys)."""
from __future__ import annotations

import torch

from attnops.testing import golden_dsa as G


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def pack_query(parts, layout, rows=None):
    """Per-batch ``[Lq_b, ...]`` tensors -> BSND ``[B, rows, ...]`` (zero padded) or TND ``[T (+ padding), ...]``;
    returns (packed, lengths tensor: per batch for BSND, cumulative for TND)."""
    lens = [p.shape[0] for p in parts]
    if layout == "TND":
        packed = torch.cat(parts + [torch.zeros(rows or 0, *parts[0].shape[1:], dtype=parts[0].dtype)])
        return packed, torch.tensor(list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    s = rows or max(lens)
    packed = torch.zeros(len(parts), s, *parts[0].shape[1:], dtype=parts[0].dtype)
    for b, p in enumerate(parts):
        packed[b, :p.shape[0]] = p
    return packed, torch.tensor(lens, dtype=torch.int32)


def pack_keys(parts, layout, *, block_size=16, seed=0):
    """Per-batch ``[Lk_b, D]`` keys -> (key with a kv-head dim of 1, lengths tensor, block_table or None) in
    ``layout`` (PA_BSND: blocks in a shuffled order, -1 past each batch's blocks). ``parts`` may be a list of
    lists (several tensors sharing one paging)."""
    groups = parts if isinstance(parts[0], (list, tuple)) else [parts]
    lens = [p.shape[0] for p in groups[0]]
    if layout != "PA_BSND":
        out = [pack_query([p[:, None] for p in g], layout)[0] for g in groups]
        lengths = pack_query([p[:, None] for p in groups[0]], layout)[1]
        return (out if groups is parts else out[0]), lengths, None
    nblocks = [-(-n // block_size) for n in lens]
    total = sum(nblocks) + 2
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    table = torch.full((len(lens), max(max(nblocks), 1) + 1), -1, dtype=torch.int32)
    caches = [torch.zeros(total, block_size, 1, g[0].shape[-1], dtype=g[0].dtype) for g in groups]
    used = 0
    for b, n in enumerate(lens):
        for blk in range(nblocks[b]):
            phys = int(perm[used])
            used += 1
            table[b, blk] = phys
            for cache, g in zip(caches, groups):
                rows = g[b][blk * block_size:(blk + 1) * block_size]
                cache[phys, :rows.shape[0], 0] = rows
    return (caches if groups is parts else caches[0]), torch.tensor(lens, dtype=torch.int32), table


def golden_sfa(qs, ks, vs, rows, scale, **kw):
    """The golden over every batch, concatenated: (out [R, N, Dv], max [R, N], sum [R, N])."""
    q_rope, k_rope = kw.pop("q_rope", None), kw.pop("k_rope", None)
    parts = [G.sparse_flash_attention(q, k, v, r, scale, q_rope=None if q_rope is None else q_rope[b],
                                      k_rope=None if k_rope is None else k_rope[b], **kw)
             for b, (q, k, v, r) in enumerate(zip(qs, ks, vs, rows))]
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))


def random_rows(q_lens, k_lens, count, *, block=1, sparse_mode=3, seed=0):
    """Per batch, index rows of distinct allowed entries (blocks of ``block`` positions), -1 padded."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for lq, lk in zip(q_lens, k_lens):
        rows = []
        for i in range(lq):
            a = -(-G.allowed(lq, lk, i, sparse_mode) // block)
            pick = torch.randperm(a, generator=g)[:count].tolist() if a else []
            rows.append(pick + [-1] * (count - len(pick)))
        out.append(rows)
    return out


def pack_rows(rows, layout, s1=None):
    """Index rows per batch -> sparse_indices int32 ``[B, S1, 1, K]`` (padding rows -1) or ``[T1, 1, K]``."""
    parts = [torch.tensor(r, dtype=torch.int32).view(len(r), 1, -1) if r else torch.empty(0, 1, 1, dtype=torch.int32)
             for r in rows]
    k = max(p.shape[-1] for p in parts)
    parts = [p if p.numel() else torch.empty(0, 1, k, dtype=torch.int32) for p in parts]
    if layout == "TND":
        return torch.cat(parts)
    s = s1 or max(p.shape[0] for p in parts)
    out = torch.full((len(parts), s, 1, k), -1, dtype=torch.int32)
    for b, p in enumerate(parts):
        out[b, :p.shape[0]] = p
    return out


def unpack_rows(x, layout, q_lens):
    """Flat ``[R, ...]`` view of a packed query-side tensor restricted to the valid rows, batch after batch."""
    if layout == "TND":
        return x[:sum(q_lens)]
    return torch.cat([x[b, :n] for b, n in enumerate(q_lens)])


def unpack_keys(x, layout, k_lens, table=None):
    """The valid rows ``[sum Lk_b, ...]`` of a packed key-side tensor (:func:`pack_keys`' layouts), batch after
    batch."""
    if layout == "TND":
        return x[:sum(k_lens), 0]
    if layout == "BSND":
        return torch.cat([x[b, :n, 0] for b, n in enumerate(k_lens)])
    page = x.shape[1]
    return torch.cat([x[table[b, torch.arange(n) // page].long(), torch.arange(n) % page, 0]
                      for b, n in enumerate(k_lens)])


def golden_sfa_grads(qs, qr, ks, kr, vs, rows, grads, scale, **kw):
    """fp64 autograd of the golden per batch: ``(dq, dq_rope, dk, dk_rope, dv)`` over every batch, concatenated
    (``qr``/``kr`` None without rope; ``vs`` None: the value is the key, its gradient part of ``dk``)."""
    out = [[] for _ in range(5)]
    for b, g in enumerate(grads):
        leaves = [None if t is None else t[b].double().requires_grad_() for t in (qs, qr, ks, kr, vs)]
        q, q_rope, k, k_rope, v = leaves
        o = G.sparse_flash_attention(q, k, k if v is None else v, rows[b], scale, q_rope=q_rope, k_rope=k_rope,
                                     **kw)[0]
        if o.numel():
            torch.autograd.backward(o, g.double())
        for i, leaf in enumerate(leaves):
            if leaf is not None:
                out[i].append(torch.zeros_like(leaf) if leaf.grad is None else leaf.grad)
    return tuple(torch.cat(parts) if parts else None for parts in out)
