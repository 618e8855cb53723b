"""Judge the fused-attention calls of a msprobe dump (``python -m attnops compare PATH``).

Every FlashAttention (npu_fusion_attention v1-v3, forward and backward, and its grad ops), FusedInferAttention
(npu_fused_infer_attention_score v1/v2, npu_prompt_flash_attention, npu_incre_flash_attention) and NSA (npu_nsa_*)
call in a tensor dump is re-run twice on the CPU from its dumped inputs: exactly in float64 (the golden G) and with
attnops' NPU-precision emulation (E, the rounding of the Ascend A2/A3 kernels; attnops' exact result, with a note,
where that rounding is not emulated).
Each dumped result N is judged by msprobe's benchmark standard with E in the place of the GPU: with
ratio = metric(N,G) / max(metric(E,G), minimum_err), PASS iff RMSE <= 1.5, mean rel <= 1.5, max rel <= 5 and
small-value error <= 2 (and shapes, dtypes, inf/NaN positions match; integer outputs within 1 of E; NSA
topk_indices: the same blocks per row). Calls without dumped tensors (statistics level) and features that cannot
be re-run (dropout, sink, rope) are SKIP.

Exit status: 0 when nothing failed, 1 when a call FAILs, 2 on a usage or dump format error.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

from .._progress import progress_line
from .dump import DumpFormatError
from .judge import CallResult
from .judge_path import judge_path
from .report import call_detail, summary_line, write_json, write_reports

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="msprobe dump_path, one step<N> directory or one rank/proc "
                                                     "directory (the one holding dump.json)")
    parser.add_argument("--step", type=int, help="only step<STEP> (default: every step)")
    parser.add_argument("--rank", type=int, help="only rank<RANK> (default: every rank and proc directory)")
    parser.add_argument("--api", help="only these calls: an fnmatch pattern on the API name "
                                      "('npu_fusion_attention*') or on the entry name ('*.0.backward')")
    parser.add_argument("--out", metavar="DIR", help="write report.md, report.html and error histograms here")
    parser.add_argument("--json", metavar="FILE", help="write one JSON record per compared tensor")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="judge N calls at once in worker processes, each with 1/N of torch's intra-op threads "
                             "(a call number's forward and backward stay together); the results keep dump order")
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--progress", action="store_true",
                       help="a progress line per judged call on stderr even when stderr is not a terminal")
    shown.add_argument("--quiet", action="store_true", help="no progress lines (default: on a terminal only)")


def _usage_error(message: str) -> int:
    """Print the one-line error and return the usage-error exit status (2; 1 is a FAIL verdict)."""
    print(f"attnops compare: {message}", file=sys.stderr)
    return 2


def _output_problem(out: str | None, json_file: str | None) -> str | None:
    """Why ``--out`` or ``--json`` cannot be written, checked before any call is judged (None: both can)."""
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        return f"--out {out!r}: expected a directory (existing or to create), got an existing file"
    if json_file is not None:
        if Path(json_file).is_dir():
            return f"--json {json_file!r}: expected a file to write, got a directory"
        parent = Path(json_file).parent
        if not parent.is_dir():
            return f"--json {json_file!r}: expected a file in an existing directory, got one in {str(parent)!r}"
    return None


class _ProgressLines:
    """``[k/n] VERDICT  where  call  elapsed .., ETA ..`` on stderr as each call's result arrives."""

    def __init__(self):
        self.start = time.monotonic()

    def __call__(self, r: CallResult, done: int, total: int) -> None:
        elapsed = time.monotonic() - self.start
        eta = elapsed * (total - done) / done
        print(progress_line(done, total, f"{r.verdict}  {r.where}  {r.call}", elapsed, eta), file=sys.stderr,
              flush=True)


def _show_progress(args: argparse.Namespace) -> bool:
    return args.progress or (not args.quiet and sys.stderr.isatty())


def run(args: argparse.Namespace) -> int:
    problem = _output_problem(args.out, args.json) or (
        f"--jobs {args.jobs}: expected a positive number of processes" if args.jobs < 1 else None)
    if problem:
        return _usage_error(problem)
    gc.freeze()  # the objects alive now (modules, torch) are never collected: tensor-heavy re-runs trigger the
    # collector often, and each full collection would walk them all again
    try:
        results = judge_path(args.path, step=args.step, rank=args.rank, api=args.api, jobs=args.jobs,
                             on_result=_ProgressLines() if _show_progress(args) else None)
    except (DumpFormatError, OSError) as exc:
        return _usage_error(str(exc))
    if args.api is not None and not results:
        return _usage_error(f"--api {args.api!r} matches no fused-attention call in {args.path}")
    for r in results:
        detail = call_detail(r)
        print(f"{r.verdict:4}  {r.where}  {r.call}" + (f"  ({detail})" if detail else ""))
    print(summary_line(results))
    try:
        if args.json:
            write_json(results, args.json)
        if args.out:
            print(f"report: {write_reports(results, args.out)}")
    except OSError as exc:
        return _usage_error(f"cannot write the report: {exc}")
    return 1 if any(r.verdict == "FAIL" for r in results) else 0
