"""Judge the fused-attention calls of a msprobe dump (``python -m attnops compare PATH``).

Every npu_fusion_attention(_v2) and npu_nsa_select_attention forward and backward, and every
npu_fused_infer_attention_score, npu_prompt_flash_attention and npu_incre_flash_attention call in a tensor dump
is re-run twice on the CPU from its dumped inputs: exactly in float64 (the golden G) and with attnops'
NPU-precision emulation (E, the rounding of the Ascend A2/A3 kernels).
Each dumped result N is judged by msprobe's benchmark standard with E in the place of the GPU: with
ratio = metric(N,G) / max(metric(E,G), minimum_err), PASS iff RMSE <= 1.5, mean rel <= 1.5, max rel <= 5 and
small-value error <= 2 (and shapes, dtypes, inf/NaN positions match; integer outputs within 1 of E). Calls
without dumped tensors (statistics level) and features that cannot be re-run (dropout, sink, rope) are SKIP.

Exit status: 0 when nothing failed, 1 when a call FAILs, 2 on a usage or dump format error.
"""
from __future__ import annotations

import argparse
import sys

from .dump import DumpFormatError
from .judge import judge_path
from .report import summary_line, write_json, write_reports

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


def run(args: argparse.Namespace) -> int:
    try:
        results = judge_path(args.path, step=args.step, rank=args.rank, api=args.api)
    except DumpFormatError as exc:
        print(f"attnops compare: {exc}", file=sys.stderr)
        return 2
    if args.api is not None and not results:
        print(f"attnops compare: --api {args.api!r} matches no fused-attention call in {args.path}", file=sys.stderr)
        return 2
    for r in results:
        detail = r.reason or "; ".join(f"{t.tensor} {t.name}: {', '.join(t.verdict.reasons)}"
                                       for t in r.tensors if t.verdict.reasons)
        print(f"{r.verdict:4}  {r.where}  {r.call}" + (f"  ({detail})" if detail else ""))
    print(summary_line(results))
    if args.json:
        write_json(results, args.json)
    if args.out:
        print(f"report: {write_reports(results, args.out)}")
    return 1 if any(r.verdict == "FAIL" for r in results) else 0
