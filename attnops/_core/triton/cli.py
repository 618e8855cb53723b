"""``python -m attnops aot [--target sm_90|sm_80|all] [--filter TEXT] [--json FILE] [--check]``: compile every
registered Triton kernel (:mod:`.registry`) at its launch configurations down to cubin without a GPU and print one
row per compiled variant (on the targets whose launcher runs it): operator, case, kernel, tiles, warps, stages,
registers, spills, shared memory (bytes), whether it is the configuration the launcher runs ("default": the launch's
first) and the PTX's instruction mix (wgmma/mma.sync/cp.async/TMA/narrow global loads, :class:`~.aot.PtxCounts`).
``--json FILE`` writes the same, one record per variant. ``--check`` also applies the Hopper fast-path rules
(:mod:`.fast_path`). Exits 1 when a kernel fails to compile, needs more shared memory than the target has, or (with
``--check``) breaks a rule."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

INTERPRET_VARS = ("TRITON_INTERPRET", "ATTNOPS_TRITON_INTERPRET")
HEADER = ("operator", "case", "target", "kernel", "tiles", "warps", "stages", "regs", "spills", "shared", "default",
          "wgmma/mma/cp.async/tma/narrow", "result")


def _record(case, target: str, v) -> dict:
    """The JSON record of compiled variant ``v`` of ``case`` on ``target``."""
    return dict(operator=case.operator, case=case.name, kernel=v.kernel, target=target, tiles=v.tiles,
                warps=v.num_warps, stages=v.num_stages, registers=v.n_regs, spills=v.n_spills, shared=v.shared,
                default=v.default, ptx=dataclasses.asdict(v.ptx))


def _rows(targets: list[str], pattern: str, kernel: str) -> tuple[list[tuple], list[dict], int]:
    from .aot import SHARED_LIMIT, TARGETS, compile_launch
    from .registry import all_aot_cases

    rows, records, failures = [], [], 0
    cases = [c for key, c in all_aot_cases().items() if pattern in key]
    if not cases:
        raise SystemExit(f"no AOT case matches {pattern!r}")
    for case in cases:
        launches = [launch for launch in case.launches() if kernel in launch.kernel]
        for target in targets:
            arch = TARGETS[target][1]
            for launch in (launch for launch in launches if target in launch.targets):
                try:
                    variants = compile_launch(launch, TARGETS[target])
                except Exception as e:  # reported as a failed row; the exit status says so
                    failures += 1
                    rows.append((case.operator, case.name, target, launch.kernel, "", "", "", "", "", "", "", "",
                                 f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"))
                    continue
                for v in variants:
                    fits = v.shared <= SHARED_LIMIT[arch]
                    failures += not fits
                    tiles = " ".join(f"{k}={val}" for k, val in sorted(v.tiles.items()))
                    verdict = "ok" if fits else f"FAIL shared > {SHARED_LIMIT[arch]}"
                    rows.append((case.operator, case.name, target, v.kernel, tiles, v.num_warps, v.num_stages,
                                 v.n_regs, v.n_spills, v.shared, "yes" if v.default else "", v.ptx.describe(),
                                 verdict))
                    records.append(_record(case, target, v))
                print(f"  {case.operator}/{case.name} {launch.kernel} {target}", file=sys.stderr, flush=True)
    return rows, records, failures


def _print(rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    for row in [HEADER, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnops aot", description=__doc__)
    parser.add_argument("--target", default="all", choices=("sm_90", "sm_80", "all"))
    parser.add_argument("--filter", default="", help="only cases whose 'operator/case' contains this text")
    parser.add_argument("--kernel", default="", help="only kernels whose name contains this text")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="also write one JSON record per compiled variant (resources, default, PTX counts)")
    parser.add_argument("--check", action="store_true",
                        help="fail on any break of the Hopper fast-path rules (wgmma, vector loads, no spills)")
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
    rows, records, failures = _rows(["sm_90", "sm_80"] if args.target == "all" else [args.target], args.filter,
                                    args.kernel)
    _print(rows)
    if args.json is not None:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
        print(f"wrote {args.json}")
    print(f"{len(rows)} variant(s), {failures} failure(s) in {time.perf_counter() - start:.1f} s")
    if args.check:
        from .fast_path import violations

        broken = violations(records)
        print("\n".join(broken + [f"{len(broken)} fast-path rule violation(s)"]))
        failures += len(broken)
    return 1 if failures else 0
