"""``python -m attnops aot [--target sm_90|sm_80|all] [--filter TEXT]``: compile every registered Triton kernel
(:mod:`.registry`) at its launch configurations down to cubin without a GPU and print one row per compiled
variant: operator, case, kernel, tiles, warps, stages, registers, spills, shared memory (bytes). Exits 1 when a kernel
fails to compile or needs more shared memory than the target has."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

INTERPRET_VARS = ("TRITON_INTERPRET", "ATTNOPS_TRITON_INTERPRET")
HEADER = ("operator", "case", "target", "kernel", "tiles", "warps", "stages", "regs", "spills", "shared", "result")


def _rows(targets: list[str], pattern: str, kernel: str) -> tuple[list[tuple], int]:
    from .aot import SHARED_LIMIT, TARGETS, compile_launch
    from .registry import all_aot_cases

    rows, failures = [], 0
    cases = [c for key, c in all_aot_cases().items() if pattern in key]
    if not cases:
        raise SystemExit(f"no AOT case matches {pattern!r}")
    for case in cases:
        launches = [launch for launch in case.launches() if kernel in launch.kernel]
        for target in targets:
            arch = TARGETS[target][1]
            for launch in launches:
                try:
                    variants = compile_launch(launch, TARGETS[target])
                except Exception as e:  # reported as a failed row; the exit status says so
                    failures += 1
                    rows.append((case.operator, case.name, target, launch.kernel, "", "", "", "", "", "",
                                 f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"))
                    continue
                for v in variants:
                    fits = v.shared <= SHARED_LIMIT[arch]
                    failures += not fits
                    tiles = " ".join(f"{k}={val}" for k, val in sorted(v.tiles.items()))
                    verdict = "ok" if fits else f"FAIL shared > {SHARED_LIMIT[arch]}"
                    rows.append((case.operator, case.name, target, v.kernel, tiles, v.num_warps, v.num_stages,
                                 v.n_regs, v.n_spills, v.shared, verdict))
                print(f"  {case.operator}/{case.name} {launch.kernel} {target}", file=sys.stderr, flush=True)
    return rows, failures


def _print(rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    for row in [HEADER, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnops aot", description=__doc__)
    parser.add_argument("--target", default="all", choices=("sm_90", "sm_80", "all"))
    parser.add_argument("--filter", default="", help="only cases whose 'operator/case' contains this text")
    parser.add_argument("--kernel", default="", help="only kernels whose name contains this text")
    args = parser.parse_args(argv)
    if any(os.environ.get(v) for v in INTERPRET_VARS):  # the compiled kernels need Triton without its interpreter
        env = {k: v for k, v in os.environ.items() if k not in INTERPRET_VARS}
        return subprocess.run([sys.executable, "-m", "attnops", "aot", *(argv or sys.argv[2:])], env=env).returncode
    try:
        import triton  # noqa: F401
    except ImportError:
        print("python -m attnops aot needs Triton (pip install triton)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows, failures = _rows(["sm_90", "sm_80"] if args.target == "all" else [args.target], args.filter, args.kernel)
    _print(rows)
    print(f"{len(rows)} variant(s), {failures} failure(s) in {time.perf_counter() - start:.1f} s")
    return 1 if failures else 0
