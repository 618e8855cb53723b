"""torch_npu FIA layouts beyond the core's (BSH, BSND, BNSD, BNSD_BSND, TND): ``NTD``, ``NSD`` and the ``X_Y``
forms writing BNSD, NBSD, TND or NTD, as op-plugin's meta functions shape them.

Such a call runs in a core layout: the query-like tensors (and a dense key/value) are viewed in it (``NTD`` ->
``TND``, ``NSD`` -> ``BNSD`` with B = 1), and the core's output is rearranged into the written layout. The lse
keeps the core's shape, which is the NPU's: ``[T, N, 1]`` for the TND/NTD forms, ``[B, N, S, 1]`` otherwise.
"""
from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class LayoutPlan(NamedTuple):
    core: str  # the layout the core runs in (its input_layout argument)
    reads: str | None  # NTD or NSD: the inputs' own layout, None when they are in the core layout
    writes: str | None  # the output layout when it differs from the core's output layout


PLANS = {
    "NTD": LayoutPlan("TND", "NTD", "NTD"),
    "NTD_TND": LayoutPlan("TND", "NTD", None),
    "TND_NTD": LayoutPlan("TND", None, "NTD"),
    "NSD": LayoutPlan("BNSD", "NSD", "NSD"),
    "BSH_BNSD": LayoutPlan("BSH", None, "BNSD"),
    "BSND_BNSD": LayoutPlan("BSND", None, "BNSD"),
    "BSH_NBSD": LayoutPlan("BSH", None, "NBSD"),
    "BSND_NBSD": LayoutPlan("BSND", None, "NBSD"),
    "BNSD_NBSD": LayoutPlan("BNSD", None, "NBSD"),
}


def plan(input_layout) -> LayoutPlan:
    """The plan of a torch_npu-only layout; other names run as given (the core validates them)."""
    name = input_layout.upper() if isinstance(input_layout, str) else input_layout
    return PLANS.get(name, LayoutPlan(input_layout, None, None))


def to_core(x: Tensor | None, reads: str | None) -> Tensor | None:
    """A tensor in the ``reads`` layout as a view in the core layout (``NTD`` -> ``TND``, ``NSD`` -> ``BNSD``)."""
    if x is None or reads is None:
        return x
    return x.transpose(0, 1) if reads == "NTD" else x.unsqueeze(0)


def from_core(out: Tensor, core_out: str, writes: str | None, heads: int) -> Tensor:
    """The core's output (in layout ``core_out``) in the ``writes`` layout."""
    if writes is None:
        return out
    if writes == "NTD":  # from TND
        return out.transpose(0, 1).contiguous()
    if writes == "NSD":  # from BNSD with B = 1
        return out.squeeze(0)
    bsnd = out.unflatten(-1, (heads, -1)) if core_out == "BSH" else out  # [B, S, N, D] (or BNSD)
    if writes == "BNSD":
        return bsnd.transpose(1, 2).contiguous()
    return (bsnd.permute(1, 0, 2, 3) if core_out == "BNSD" else bsnd.permute(2, 0, 1, 3)).contiguous()  # NBSD
