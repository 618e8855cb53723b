"""What context parallelism sends: the byte counter of :mod:`.comm`'s collectives, and the formulas it matches.

The formulas give the bytes one rank sends per attention layer (one forward, one backward) in terms of the local
tensors' sizes in bytes (``q``, ``k``, ``v``, ``o`` = the output; 16-bit or fp32 as given) and ``f32`` = the fp32
size factor ``4 / element_size``: P ranks (ring / all-gather), U Ulysses x R ring ranks (hybrid), ``rep`` the
repeat factor Ulysses applies to KV heads. They exclude the cross-rank argument check (kind ``rank_check``) and the
dropout seed broadcast.
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["Traffic", "count_traffic", "formula_bytes"]


class Traffic:
    """Bytes this process sends through the collectives of :mod:`attnops.distributed`, per kind, while counting
    (:func:`count_traffic`): what the other ranks must receive from this one, whatever algorithm the backend uses
    (point-to-point: the tensor; all-to-all: the ``P-1`` slots for other ranks; all-gather: the local tensor to each
    of ``P-1`` ranks; reduce-scatter: the ``P-1`` slots of other ranks; broadcast: the root, to ``P-1`` ranks)."""

    def __init__(self):
        self.bytes: dict[str, int] = {}

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + int(nbytes)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


_traffic: list[Traffic] = []


@contextlib.contextmanager
def count_traffic():
    """Count the bytes this process sends inside the block: ``with count_traffic() as t: ...; t.total``."""
    traffic = Traffic()
    _traffic.append(traffic)
    try:
        yield traffic
    finally:
        _traffic.remove(traffic)


def record(kind: str, nbytes: int) -> None:
    for traffic in _traffic:
        traffic.add(kind, nbytes)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def formula_bytes(mode: str, *, q: int, k: int, v: int, o: int, f32: float, p: int = 1, u: int = 1, r: int = 1,
                  rep: int = 1) -> dict[str, int]:
    """``{"fwd": bytes, "bwd": bytes}`` one rank sends per layer in ``mode`` ("ring", "ulysses", "hybrid",
    "allgather") for local tensors of ``q``/``k``/``v``/``o`` bytes (see the module docstring)."""
    if mode == "ring":  # K/V travel P-1 steps; dK/dV (fp32) are sent at each of the P steps
        return {"fwd": (p - 1) * (k + v), "bwd": (p - 1) * (k + v) + (p if p > 1 else 0) * int(f32 * (k + v))}
    if mode == "ulysses":  # one all-to-all each: q, k, v, out; back: dout, dq, dk, dv
        a2a = (q + rep * (k + v) + o) * (p - 1) // p
        return {"fwd": a2a, "bwd": a2a}
    if mode == "hybrid":  # Ulysses over U, then the ring over R on the gathered sequence for N/U heads
        ring = formula_bytes("ring", q=q, k=rep * k, v=rep * v, o=o, f32=f32, p=r)
        uly = formula_bytes("ulysses", q=q, k=k, v=v, o=o, f32=f32, p=u, rep=rep)
        return {key: ring[key] + uly[key] for key in ("fwd", "bwd")}
    if mode == "allgather":  # K/V to P-1 ranks; dK/dV (fp32) reduce-scattered: P-1 slots of the local size
        return {"fwd": (p - 1) * (k + v), "bwd": (p - 1) * int(f32 * (k + v))}
    raise ValueError(f"mode: expected one of ring, ulysses, hybrid, allgather, got {mode!r}")
