"""``python -m attnops.gpu.triton_check [--filter TEXT]``: the ``attnops check`` cases on the Triton backend only
(the rows ``gpu-report --interpret`` runs through Triton's interpreter); exits 1 when a row fails or none runs."""
from __future__ import annotations

import argparse
import sys

from ..check import all_cases, available_backends, print_table, run_case


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnops.gpu.triton_check", description=__doc__)
    parser.add_argument("--filter", default="", help="only cases whose operator or name contains this text")
    args = parser.parse_args(argv)
    if "triton" not in available_backends():
        print("the triton backend is unavailable: needs CUDA, or ATTNOPS_TRITON_INTERPRET=1, and Triton installed",
              file=sys.stderr)
        return 1
    rows = [run_case(case, "triton") for case in all_cases()
            if "triton" in case.backends and (args.filter in case.operator or args.filter in case.name)]
    print_table(rows)
    failed = sum(not r.ok for r in rows)
    print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
