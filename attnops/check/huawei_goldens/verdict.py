"""How one output of attnops and of Huawei's golden are judged side by side, and the table of results.

Both are judged against G, attnops' exact result on the same inputs in float64, with the project's tolerance rule
(:mod:`attnops.testing.compare`) used in both directions: attnops is within the bound when
``err_attnops <= 2 * err_huawei + floor`` and Huawei's golden when ``err_huawei <= 2 * err_attnops + floor``
(``floor`` of G, the output dtype and the reduction length). Both computations accumulate in fp32 and round to the
output dtype, so each is the other's low-precision baseline. They AGREE when both are within the bound; otherwise
the side outside it is the one that deviates (at most one can be).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...testing.compare import default_floor, max_abs_err


@dataclass
class Row:
    """One compared output of one case."""

    operator: str
    case: str
    output: str
    err_attnops: float
    err_huawei: float
    diff: float
    bound_attnops: float
    bound_huawei: float
    scale: float = 0.0  # max |G|, for the reader: the errors are at the rounding of the outputs at this magnitude
    note: str = ""
    exact: bool = False  # an integer output: AGREE when equal, else DIFFER
    error: bool = False  # the case raised (the note says what)

    @property
    def verdict(self) -> str:
        if self.error:
            return "ERROR"
        if self.exact:
            return "AGREE" if self.diff == 0 else "DIFFER"
        if not self.err_huawei <= self.bound_huawei:
            return "HUAWEI OFF"
        if not self.err_attnops <= self.bound_attnops:
            return "ATTNOPS OFF"
        return "AGREE"


def judge(operator: str, case: str, output: str, attnops: Tensor, huawei: Tensor, golden: Tensor, *,
          reduction: int, note: str = "") -> Row:
    """``attnops`` and ``huawei`` (the same shape) against ``golden`` (float64), both ways round."""
    huawei = huawei.to(attnops.dtype)
    err_a, err_h = max_abs_err(attnops, golden), max_abs_err(huawei, golden)
    floor = default_floor(golden, attnops.dtype, reduction)
    g = golden.abs()
    scale = float(g[torch.isfinite(g)].max()) if bool(torch.isfinite(g).any()) else 0.0
    return Row(operator, case, output, err_a, err_h, max_abs_err(attnops, huawei), 2.0 * err_h + floor,
               2.0 * err_a + floor, scale, note)


def exact(operator: str, case: str, output: str, mismatches: int, note: str = "") -> Row:
    """An integer output: ``mismatches`` counts the elements (or rows) where attnops and Huawei differ."""
    return Row(operator, case, output, 0.0, 0.0, float(mismatches), 0.0, 0.0, note=note, exact=True)


def failed(operator: str, case: str, exc: Exception) -> Row:
    """A case that raised: attnops rejected a call Huawei's test makes, or the generator failed."""
    return Row(operator, case, "-", 0.0, 0.0, 0.0, 0.0, 0.0, note=f"{type(exc).__name__}: {exc}", error=True)


def print_table(rows: list[Row]) -> None:
    header = ("operator", "case", "output", "max |G|", "err attnops", "err huawei", "|attnops-huawei|", "verdict")
    cells = [header] + [(r.operator, r.case, r.output, f"{r.scale:.2e}", f"{r.err_attnops:.2e}",
                         f"{r.err_huawei:.2e}", f"{r.diff:.2e}", r.verdict) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    for i, c in enumerate(cells):
        print("  ".join(s.ljust(w) for s, w in zip(c, widths)), flush=True)
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for r in rows:
        if r.note:
            print(f"note {r.operator} {r.case} {r.output}: {r.note}")
