"""Command line: ``python -m attnops check`` (operators vs the fp64 golden) and ``python -m attnops bench``."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"check": "run every operator against the fp64 golden and print a table",
                "bench": "run the benchmark suites (see --help)",
                "gpu-report": "validate and time every GPU path in one run (see docs/gpu.md)",
                "aot": "compile every Triton kernel ahead of time for sm_80/sm_90, no GPU needed"}
    if not argv or argv[0] not in commands:
        print("usage: python -m attnops {check,bench,gpu-report,aot} [options]")
        for name, text in commands.items():
            print(f"  {name:10s} {text}")
        return 2
    if argv[0] == "gpu-report":
        from .gpu.report import main as gpu_report_main

        return gpu_report_main(argv[1:])
    if argv[0] == "aot":
        from ._core.triton.cli import main as aot_main

        return aot_main(argv[1:])
    if argv[0] == "check":
        from .check import main as check_main

        return check_main(argv[1:])
    from .bench import main as bench_main

    return bench_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
