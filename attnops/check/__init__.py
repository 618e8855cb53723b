"""``python -m attnops check``: run every implemented operator and dialect on every available backend over built-in
cases, compare with the fp64 golden (FlashAttention's tolerance rule), print a table and fail on any mismatch.

Rows: the aclnn operators and the Pythonic API (FlashAttention, NSA, FusedInferAttentionScore), the flash-attn functions
(:mod:`attnops.flash_attn`) and the torch_npu functions called as flash-attn and Ascend code call them, and ring /
Ulysses context parallelism at world size 2 on CPU Gloo (one spawn of two processes for all of them; a hang becomes a
FAIL row after a timeout). Backends: ``reference`` always; ``triton`` when the Triton kernels can run (CUDA and Triton
importable, or ``ATTNOPS_TRITON_INTERPRET=1`` for Triton's CPU interpreter). Only cases of operators with Triton kernels
(FlashAttention) run on ``triton``; each case runs with ``ATTNOPS_BACKEND`` set to its backend, so the aclnn functions
dispatch there too. The output starts with one line per backend: the cases it runs, or why it is skipped.
``--filter TEXT`` keeps the cases whose operator or name contains TEXT (any case; a filter that keeps nothing is an
error that lists the cases); ``--list`` prints the cases and exits."""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..ops.common import bf16_gemm, cpu_kernels
from .._core.dispatch import triton_interpret_requested
from .._progress import Progress
from ..testing.compare import default_floor, max_abs_err
from .case import CheckCase, Comparison, triton_runs_on_cuda

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
    bound = cmp.factor * base + default_floor(cmp.golden, cmp.actual.dtype, cmp.reduction)
    scale = float(cmp.golden.abs().max()) if cmp.golden.numel() else 0.0
    ok = err <= bound
    return err, err / scale if scale > 0 else err, ok, "" if ok else f"{cmp.name}: err {err:.3e} > bound {bound:.3e}"


@contextlib.contextmanager
def backend_env(backend: str) -> Iterator[None]:
    """``ATTNOPS_BACKEND=backend`` for the duration (the aclnn functions dispatch through it), then restored."""
    saved = os.environ.get("ATTNOPS_BACKEND")
    os.environ["ATTNOPS_BACKEND"] = backend
    try:
        yield
    finally:
        if saved is None:
            del os.environ["ATTNOPS_BACKEND"]
        else:
            os.environ["ATTNOPS_BACKEND"] = saved


def run_case(case: CheckCase, backend: str) -> Row:
    start = time.perf_counter()
    try:
        with backend_env(backend):
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
    from . import (context_parallel, dsa, dsv4, flash_attention, flash_attn, flash_attn_kvcache,
                   fused_infer_attention, nsa, torch_npu, torch_npu_atb)

    return (flash_attention.cases() + flash_attn.cases() + flash_attn_kvcache.cases() + nsa.cases()
            + fused_infer_attention.cases() + torch_npu.cases() + torch_npu_atb.cases() + dsa.cases()
            + dsv4.cases() + context_parallel.cases())


def triton_skip_reason() -> str | None:
    """Why the ``triton`` backend does not run here (None when it does): its kernels need Triton, and CUDA or
    Triton's CPU interpreter (``ATTNOPS_TRITON_INTERPRET=1``)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed; pip install triton"
    if not (triton_runs_on_cuda() or triton_interpret_requested()):
        return ("no CUDA device; set ATTNOPS_TRITON_INTERPRET=1 to run the Triton kernels in Triton's CPU "
                "interpreter")
    return None


def available_backends() -> list[str]:
    """``reference``, plus ``triton`` when its kernels can run (:func:`triton_skip_reason`)."""
    return ["reference"] if triton_skip_reason() else ["reference", "triton"]


def backend_report(selected: list[tuple[CheckCase, list[str]]]) -> list[str]:
    """One line per backend: how many of the selected cases it runs (and where), or why it is skipped; and where
    the CPU decode library is, when one is loaded."""
    total = f"{len(selected)} case{'s' * (len(selected) != 1)}"
    lines = [f"reference: runs {sum('reference' in on for _, on in selected)} of {total}; "
             f"CPU decode (FIA, NSA): {cpu_kernels.status()}; CPU bf16 products: "
             f"{bf16_gemm.unit() if bf16_gemm.bf16_gemm(torch.device('cpu')) else 'fp32'}"]
    where = cpu_kernels.location()
    if where is not None:
        lines.append(f"CPU decode library: {where}")
    reason = triton_skip_reason()
    if reason is not None:
        return lines + [f"triton: skipped ({reason})"]
    count = sum("triton" in on for _, on in selected)
    where = f"on CUDA ({torch.cuda.get_device_name()})" if triton_runs_on_cuda() else "in Triton's CPU interpreter"
    rest = "; the others run on the reference only" if count < len(selected) else ""
    return lines + [f"triton: runs {count} of {total} {where}{rest}"]


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


def _case_line(case: CheckCase, backends: list[str]) -> str:
    return f"{case.operator}  |  {case.name}  |  {', '.join(backends)}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--filter", default="", metavar="TEXT",
                        help="only the cases whose operator or name contains this text (any case)")
    parser.add_argument("--list", action="store_true", help="print the selected cases and their backends, run none")


def run(args: argparse.Namespace) -> int:
    """Run the selected cases and print the report; 0 when all pass, 1 on a failure, 2 when no case is selected."""
    backends = available_backends()
    cases = [(case, [b for b in backends if b in case.backends]) for case in all_cases()]
    text = args.filter.lower()
    selected = [(case, on) for case, on in cases if text in case.operator.lower() or text in case.name.lower()]
    if not selected:
        print(f"python -m attnops check: error: --filter {args.filter!r} matches no case; the cases "
              "(operator | case | backends, as --list prints them) are:", file=sys.stderr)
        print("\n".join(_case_line(case, on) for case, on in cases), file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(_case_line(case, on) for case, on in selected))
        return 0
    print("\n".join(backend_report(selected)), flush=True)
    torch.manual_seed(0)
    start = time.perf_counter()
    jobs = [(case, backend) for case, on in selected for backend in on]
    progress = Progress([1] * len(jobs), overwrite=True) if sys.stderr.isatty() else None
    rows = []
    for case, backend in jobs:
        if progress is not None:
            progress.next(f"{case.operator} [{backend}] {case.name}")
        rows.append(run_case(case, backend))
    if progress is not None:
        progress.finish()
    print_table(rows)
    failed = sum(not r.ok for r in rows)
    print(f"{len(rows) - failed} passed, {failed} failed in {time.perf_counter() - start:.1f} s "
          f"(backends: {', '.join(backends)})")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m attnops check [--filter TEXT] [--list]``."""
    from ..__main__ import main as cli

    return cli(["check", *(sys.argv[1:] if argv is None else argv)])
