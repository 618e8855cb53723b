"""``python -m attnops.gpu.tune --dir DIR [--seconds S] [--repeats N] [--quick] [--interpret]``: the ``tune`` step of
``gpu-report --tune``. Runs attnops on the representative shapes of every GPU suite (its quick cases; through the
interpreter its smoke stand-in's) inside a tuning session (:mod:`attnops._core.triton.tuning`) and writes the
table of this GPU and Triton version into ``DIR`` (:mod:`attnops._core.triton.tuned` reads it), merged over the
entries of an earlier table there. The table is rewritten after every case, so a run cut short keeps what it
measured."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

from .._core.triton import tuned, tuning
from .suites import GPU_SUITES

INTERPRETER_GPU = "cpu-interpreter"  # the table's GPU name through the interpreter (no launcher reads it)


def workloads(interpret: bool, quick: bool) -> list:
    """``(suite, case)`` pairs: each GPU suite's quick cases (``--quick``: the first of each), or through the
    interpreter its smoke suite's quick cases."""
    from ..bench.cases import suite_cases

    pairs = []
    for suite in GPU_SUITES.values():
        name, pattern = (suite.smoke_suite, suite.smoke_quick_filter) if interpret else (suite.suite,
                                                                                          suite.quick_filter)
        cases = [c for c in suite_cases(name) if re.search(pattern, c.name)]
        pairs += [(name, c) for c in (cases[:1] if quick else cases)]
    return pairs


def table_path(directory: Path, interpret: bool) -> tuple[Path, str, str]:
    """``(path, gpu, triton version)`` of this machine's table in ``directory``."""
    import triton

    gpu = INTERPRETER_GPU if interpret else torch.cuda.get_device_name(0)
    return directory / tuned.table_name(gpu, triton.__version__), gpu, triton.__version__


def write_table(path: Path, gpu: str, triton_version: str, entries: dict) -> None:
    """The table at ``path``: the earlier one's entries with ``entries`` over them."""
    merged = {}
    if path.is_file():
        merged = {(e["family"], e["kernel"], e["bucket"]): e for e in json.loads(path.read_text())["entries"]}
    merged.update(entries)
    table = dict(format=tuned.FORMAT, gpu=gpu, triton=triton_version, torch=torch.__version__,
                 date=time.strftime("%Y-%m-%d", time.gmtime()),
                 entries=[merged[k] for k in sorted(merged)])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")


def run(directory: Path, seconds: float, repeats: int, quick: bool, interpret: bool) -> int:
    from ..bench.impls import BUILDERS, OURS, make_inputs

    device = torch.device("cpu" if interpret else "cuda")
    if interpret:  # on CPU tensors ``auto`` picks the reference; tuning is about the kernels
        os.environ["ATTNOPS_BACKEND"] = "triton"
    failed = 0
    path, gpu, version = table_path(directory, interpret)
    with tuning.session(repeats, seconds) as session:
        for suite, case in workloads(interpret, quick):
            if time.monotonic() > session.deadline:
                break
            print(f"tune {suite} {case.name}", flush=True)
            try:
                runnable = BUILDERS[OURS](case, make_inputs(case, device), device)
                runnable.reset()
                runnable.fn()
                if device.type == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - one failing case must not stop the others' tuning
                failed += 1
                print(f"  failed: {type(e).__name__}: {e}"[:300], flush=True)
            write_table(path, gpu, version, session.entries)
    write_table(path, gpu, version, session.entries)
    faster = sum(e["chosen"] != e["default"] for e in session.entries.values())
    print(f"{len(session.entries)} kernel shapes tuned ({faster} faster than the default): {path}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnops.gpu.tune", description=__doc__)
    p.add_argument("--dir", required=True, help="folder of the tuned tables")
    p.add_argument("--seconds", type=float, default=120, help="no new kernel shape starts after this many seconds")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per candidate (the median counts)")
    p.add_argument("--quick", action="store_true", help="the first quick case of each suite only")
    p.add_argument("--interpret", action="store_true", help="through Triton's interpreter on the CPU")
    args = p.parse_args(argv)
    if not args.interpret and not torch.cuda.is_available():
        print("tuning needs a CUDA GPU (or --interpret)", file=sys.stderr)
        return 2
    return run(Path(args.dir), args.seconds, args.repeats, args.quick, args.interpret)


if __name__ == "__main__":
    sys.exit(main())
