"""Bytes sent per rank, counted around the collectives, against :func:`attnops.distributed.traffic.formula_bytes`
(run inside spawned workers)."""
from __future__ import annotations

import functools

import torch

from attnops.distributed import (allgather_flash_attention, hybrid_flash_attention, ring_flash_attention,
                                 ulysses_flash_attention)
from attnops.distributed.comm import set_rank_checks
from attnops.distributed.traffic import count_traffic, formula_bytes
from tests.helpers import randn


def _sent(fn, q, k, v) -> dict[str, int]:
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with count_traffic() as fwd:
        out = fn(*leaves)
    with count_traffic() as bwd:
        out.backward(torch.ones_like(out))
    return {name: t.total - t.bytes.get("rank_check", 0) for name, t in (("fwd", fwd), ("bwd", bwd))}


def check_traffic(world: int, groups, dtype: torch.dtype) -> None:
    """Every mode on BSND ``[1, 8, 4, 8]`` q (GQA: 1 KV head, so Ulysses repeats it), Dv = 4, causal."""
    q, k, v = randn(1, 8, 4, 8, dtype=dtype), randn(1, 8, 1, 8, dtype=dtype), randn(1, 8, 1, 4, dtype=dtype)
    size = {n: x.numel() * x.element_size() for n, x in (("q", q), ("k", k), ("v", v))}
    size["o"] = q.numel() // 2 * q.element_size()  # Dv = D / 2
    f32 = 4 / q.element_size()
    u = groups.ulysses.size()
    modes = {
        "ring": (functools.partial(ring_flash_attention, layout="BSND", causal=True), dict(p=world)),
        "ulysses": (functools.partial(ulysses_flash_attention, causal=True), dict(p=world, rep=world)),
        "allgather": (functools.partial(allgather_flash_attention, causal=True), dict(p=world)),
        "hybrid": (functools.partial(hybrid_flash_attention, ulysses_group=groups.ulysses, ring_group=groups.ring,
                                     causal=True), dict(u=u, r=world // u, rep=u)),
    }
    set_rank_checks(False)
    try:
        for mode, (fn, geometry) in modes.items():
            sent = _sent(fn, q, k, v)
            expected = formula_bytes(mode, **size, f32=f32, **geometry)
            assert sent == expected, (mode, sent, expected)
    finally:
        set_rank_checks(True)
