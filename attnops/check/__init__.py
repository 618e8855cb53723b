"""``python -m attnops check``: run every implemented operator on every available backend over built-in cases,
compare with the fp64 golden (FlashAttention's tolerance rule), print a table and fail on any mismatch."""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..testing.compare import default_floor, max_abs_err


@dataclass
class Comparison:
    """One output of a case: backend result, fp64 golden and the low-precision baseline; ``factor`` 2 or 3."""

    name: str
    actual: torch.Tensor | None
    golden: torch.Tensor | None
    baseline: torch.Tensor | None
    factor: float = 2.0


@dataclass
class CheckCase:
    operator: str
    name: str
    run: Callable[[str], list[Comparison]]  # backend -> comparisons


@dataclass
class Row:
    operator: str
    backend: str
    case: str
    max_abs: float
    rel: float
    seconds: float
    ok: bool
    detail: str = ""


def _judge(cmp: Comparison) -> tuple[float, float, bool, str]:
    if cmp.actual is None or cmp.golden is None:
        ok = cmp.actual is None and cmp.golden is None
        return 0.0, 0.0, ok, "" if ok else f"{cmp.name}: one side is None"
    err = max_abs_err(cmp.actual, cmp.golden)
    base = max_abs_err(cmp.baseline, cmp.golden) if cmp.baseline is not None else 0.0
    bound = cmp.factor * base + default_floor(cmp.golden, cmp.actual.dtype)
    scale = float(cmp.golden.abs().max()) if cmp.golden.numel() else 0.0
    ok = err <= bound
    return err, err / scale if scale > 0 else err, ok, "" if ok else f"{cmp.name}: err {err:.3e} > bound {bound:.3e}"


def run_case(case: CheckCase, backend: str) -> Row:
    start = time.perf_counter()
    try:
        comparisons = case.run(backend)
    except Exception as exc:  # a crash is a failed row, reported, not a traceback
        return Row(case.operator, backend, case.name, float("nan"), float("nan"), time.perf_counter() - start, False,
                   f"{type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - start
    worst_abs = worst_rel = 0.0
    ok, details = True, []
    for cmp in comparisons:
        err, rel, good, detail = _judge(cmp)
        worst_abs, worst_rel = max(worst_abs, err), max(worst_rel, rel)
        ok &= good
        if detail:
            details.append(detail)
    return Row(case.operator, backend, case.name, worst_abs, worst_rel, seconds, ok, "; ".join(details))


def all_cases() -> list[CheckCase]:
    from . import flash_attention, fused_infer_attention, nsa

    return list(flash_attention.cases()) + list(nsa.cases()) + list(fused_infer_attention.cases())


def available_backends() -> list[str]:
    """Backends that can run on this machine (Triton needs CUDA; the interpreter is for tests)."""
    return ["reference"]


def print_table(rows: Iterable[Row]) -> None:
    rows = list(rows)
    header = ("operator", "backend", "case", "max abs err", "rel err", "time (s)", "result")
    cells = [header] + [(r.operator, r.backend, r.case, f"{r.max_abs:.2e}", f"{r.rel:.2e}", f"{r.seconds:.3f}",
                         "PASS" if r.ok else "FAIL") for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    for i, c in enumerate(cells):
        print("  ".join(s.ljust(w) for s, w in zip(c, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for r in rows:
        if not r.ok:
            print(f"FAIL {r.operator} [{r.backend}] {r.case}: {r.detail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnops check", description=__doc__)
    parser.add_argument("--filter", default="", help="only cases whose operator or name contains this text")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = [run_case(case, backend) for case in all_cases()
            if args.filter in case.operator or args.filter in case.name for backend in available_backends()]
    print_table(rows)
    failed = sum(not r.ok for r in rows)
    print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed or not rows else 0
