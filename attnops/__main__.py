"""Command line: ``python -m attnops check`` (operators vs the fp64 golden) and ``python -m attnops bench``."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"check": "run every operator against the fp64 golden and print a table",
                "bench": "run the benchmark suites (see --help)"}
    if not argv or argv[0] not in commands:
        print("usage: python -m attnops {check,bench} [options]")
        for name, text in commands.items():
            print(f"  {name:6s} {text}")
        return 2
    if argv[0] == "check":
        from .check import main as check_main

        return check_main(argv[1:])
    from .bench import main as bench_main

    return bench_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
