"""Input layouts BSH / SBH / BSND / BNSD / TND (and FIA's ``X_Y`` input/output forms) <-> one internal token view.

The internal view of a q/k/v-like tensor is ``[B, S, N, D]`` for dense layouts and ``[T, N, D]`` for TND,
always a view (no copy). :func:`batch_tokens` returns one batch as ``[S_b, N, D]`` from either form, so
operators never branch on the layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .checks import Described, check_tensor, fail, require
from .varlen import SeqInfo

Layout = Literal["BSH", "SBH", "BSND", "BNSD", "TND"]
LAYOUTS: tuple[str, ...] = ("BSH", "SBH", "BSND", "BNSD", "TND")
_NDIM = {"BSH": 3, "SBH": 3, "BSND": 4, "BNSD": 4, "TND": 3}


IO_LAYOUTS = {"BNSD_BSND": ("BNSD", "BSND")}  # FIA: "X_Y" reads X and writes the output in Y


def normalize_layout(name: str, layout) -> str:
    if not isinstance(layout, str) or layout.upper() not in LAYOUTS:
        fail(name, f"one of {list(LAYOUTS)}", layout)
    return layout.upper()


def io_layouts(name: str, layout, allowed: tuple[str, ...]) -> tuple[str, str]:
    """``(input layout, output layout)`` of a layout name from ``allowed``; ``BNSD_BSND`` -> ``("BNSD", "BSND")``."""
    if not isinstance(layout, str) or layout.upper() not in allowed:
        fail(name, f"one of {list(allowed)}", layout)
    layout = layout.upper()
    return IO_LAYOUTS.get(layout, (layout, layout))


@dataclass(frozen=True)
class Geometry:
    """Head counts and head dims of an attention call; ``batch``/``sq``/``skv`` are the dense sizes (TND: 0)."""

    layout: str
    n1: int
    n2: int
    d: int
    dv: int
    batch: int
    sq: int
    skv: int

    @property
    def group(self) -> int:
        return self.n1 // self.n2


def bsnd_dims(x: torch.Tensor, layout: str, heads: int | None) -> tuple[int, int, int, int]:
    """(B, S, N, D) of a dense tensor; for BSH/SBH ``heads`` splits H."""
    if layout == "BSND":
        return tuple(x.shape)  # type: ignore[return-value]
    if layout == "BNSD":
        b, n, s, d = x.shape
        return b, s, n, d
    b, s, h = (x.shape[0], x.shape[1], x.shape[2]) if layout == "BSH" else (x.shape[1], x.shape[0], x.shape[2])
    assert heads is not None
    return b, s, heads, h // heads


def parse_geometry(query, key, value, head_num: int, layout: str) -> Geometry:
    """Validate q/k/v against ``layout``/``head_num`` and return the geometry (GQA and Dk >= Dv included)."""
    nd = _NDIM[layout]
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t, ndim=nd)
        require(t.shape[-1] > 0, name, "a non-empty last dimension", t)
    if layout == "TND":
        require(key.shape[0] == value.shape[0], "value", f"the same T as key ({key.shape[0]})", value)
        n1, d = query.shape[1], query.shape[2]
        n2, dk, dv = key.shape[1], key.shape[2], value.shape[2]
        require(value.shape[1] == n2, "value", f"the same number of heads as key ({n2})", value)
        require(head_num == n1, "head_num", f"the N of query ({n1})", head_num)
        batch = sq = skv = 0
    elif layout in ("BSH", "SBH"):
        h = query.shape[2]
        require(head_num > 0 and h % head_num == 0, "head_num", f"a positive divisor of the query hidden size H={h}",
                head_num)
        d = h // head_num
        n1 = head_num
        hk, hv = key.shape[2], value.shape[2]
        require(hk % d == 0, "key", f"a hidden size that is a multiple of the head dim D={d}", key)
        n2, dk = hk // d, d
        require(n2 > 0 and hv % n2 == 0, "value", f"a hidden size that is a multiple of the KV heads N2={n2}", value)
        dv = hv // n2
        batch, sq, _, _ = bsnd_dims(query, layout, n1)
        kb, skv, _, _ = bsnd_dims(key, layout, n2)
        vb, vs, _, _ = bsnd_dims(value, layout, n2)
        require(kb == batch and vb == batch, "key", f"batch size B={batch} like query", key)
        require(vs == skv, "value", f"the same sequence length as key ({skv})", value)
    else:
        batch, sq, n1, d = bsnd_dims(query, layout, None)
        kb, skv, n2, dk = bsnd_dims(key, layout, None)
        vb, vs, vn, dv = bsnd_dims(value, layout, None)
        require(head_num == n1, "head_num", f"the N of query ({n1})", head_num)
        require(kb == batch and vb == batch, "key", f"batch size B={batch} like query", key)
        require(vs == skv and vn == n2, "value", f"sequence length {skv} and {n2} heads like key", value)
    require(n2 > 0 and n1 % n2 == 0, "key", f"a number of heads N2 dividing the query heads N1={n1} (GQA)",
            Described(f"N2={n2}"))
    require(dk == d, "key", f"head dim equal to query's ({d})", Described(f"D={dk}"))
    require(dv <= d and dv > 0, "value", f"head dim 1..{d} (Dq == Dk >= Dv)", Described(f"Dv={dv}"))
    return Geometry(layout, n1, n2, d, dv, batch, sq, skv)


def tokens_view(x: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """View ``x`` as ``[B, S, N, D]`` (dense layouts) or ``[T, N, D]`` (TND) without copying."""
    if layout in ("TND", "BSND"):
        return x
    if layout == "BNSD":
        return x.permute(0, 2, 1, 3)
    split = x.unflatten(-1, (heads, x.shape[-1] // heads))
    return split if layout == "BSH" else split.permute(1, 0, 2, 3)


def token_strides(x: torch.Tensor, layout: str, heads: int) -> tuple[int, int, int]:
    """``(batch, token, head)`` element strides of :func:`tokens_view`'s view of ``x`` (TND: batch stride 0), read off
    ``x`` without making the view (a launcher's per-call path)."""
    s = x.stride()
    if layout == "TND":
        return 0, s[0], s[1]
    if layout == "BSND":
        return s[0], s[1], s[2]
    if layout == "BNSD":
        return s[0], s[2], s[1]
    head = x.shape[-1] // heads * s[-1]  # BSH / SBH: the hidden dim split into heads
    return (s[0], s[1], head) if layout == "BSH" else (s[1], s[0], head)


def with_head_dim(shape: torch.Size, layout: str, heads: int, dim: int) -> tuple[int, ...]:
    """``shape`` of a q-like tensor in ``layout`` with the head dim replaced by ``dim`` (e.g. the output's Dv)."""
    last = heads * dim if layout in ("BSH", "SBH") else dim
    return (*shape[:-1], last)


def batch_tokens(view: torch.Tensor, seq: SeqInfo, b: int, kv: bool = False) -> torch.Tensor:
    """Batch ``b`` of a token view as ``[S_b, N, D]`` (query side, or key/value side with ``kv=True``)."""
    if seq.packed:
        start, n = (seq.kv_starts[b], seq.kv_lens[b]) if kv else (seq.q_starts[b], seq.q_lens[b])
        return view[start:start + n]
    return view[b]
