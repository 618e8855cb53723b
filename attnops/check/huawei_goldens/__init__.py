"""``python -m attnops huawei-goldens --ops-transformer DIR``: attnops' DeepSeek-V4 operators side by side with
Huawei's own CPU goldens, imported at run time from a checkout of ops-transformer (``git clone`` of
cannmirror/ops-transformer; checked at commit 25fb6b92): ``GeneralizedSFA`` (sparse_flash_mla), ``cpu_compressor``
and ``GeneralizedLIV2`` (lightning_indexer). Each case makes its inputs with the golden module's own generator (or as
ops-transformer's test does), calls attnops' ``cann_ops_transformer`` op the way ops-transformer's test calls the NPU
operator, and judges attnops and Huawei against attnops' float64 result with the project's tolerance rule, in both
directions (AGREE, or which side is outside the bound). Cases: one per branch, plus ops-transformer's own parameter
sets (``ot/...``). ``--filter TEXT`` keeps the cases whose operator or name contains TEXT; ``--list`` prints them.
Without ``--ops-transformer`` the environment variable ATTNOPS_OPS_TRANSFORMER names the checkout. Exit status 0 when
every output agrees, 1 otherwise (or when a golden module cannot be imported: the reason is printed), 2 on bad
arguments."""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from . import attention, compressor, indexer
from .loader import CHECKED_COMMIT, load
from .verdict import Row, failed, print_table

ENV = "ATTNOPS_OPS_TRANSFORMER"
OPERATORS = {"sparse_flash_mla": attention, "compressor": compressor, "lightning_indexer_v2": indexer}


def all_cases(checkout: Path) -> list[tuple[str, str, dict]]:
    """(golden operator, case name, parameters): attnops' cases, then ops-transformer's parameter sets."""
    return [(op, name, params) for op, module in OPERATORS.items()
            for name, params in {**module.CASES, **module.ops_transformer_cases(checkout)}.items()]


def _commit(checkout: Path) -> str:
    if not (checkout / ".git").exists():
        return "unknown (not a git checkout)"
    try:
        return subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short=8", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def run_case(golden, op: str, index: int, name: str, params: dict) -> list[Row]:
    """One case, seeded by its position (the generators draw from the global random states)."""
    torch.manual_seed(index)
    np.random.seed(index)
    random.seed(index)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the generators' own warnings (tensor copy-construction)
            return OPERATORS[op].run_case(golden, name, params)
    except Exception as e:  # a rejected call or a failing generator is a result row, not an abort
        return [failed(OPERATORS[op].OP, name, e)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops-transformer", metavar="DIR", default=os.environ.get(ENV),
                        help=f"a checkout of ops-transformer (default: ${ENV})")
    parser.add_argument("--filter", default="", metavar="TEXT", help="only the cases whose operator or name "
                                                                      "contains this text")
    parser.add_argument("--list", action="store_true", help="print the selected cases, run none")


def run(args: argparse.Namespace) -> int:
    if not args.ops_transformer:
        print(f"python -m attnops huawei-goldens: error: pass --ops-transformer DIR or set {ENV}", file=sys.stderr)
        return 2
    checkout = Path(args.ops_transformer)
    try:
        goldens = load(checkout)
    except (FileNotFoundError, RuntimeError) as e:
        print(f"python -m attnops huawei-goldens: error: {e}", file=sys.stderr)
        return 2
    text = args.filter.lower()
    selected = [(i, op, name, p) for i, (op, name, p) in enumerate(all_cases(checkout))
                if text in op.lower() or text in name.lower()]
    if args.list:
        print("\n".join(f"{op}  |  {name}" for _, op, name, _ in selected))
        return 0
    print(f"ops-transformer at {checkout}: commit {_commit(checkout)} (checked at {CHECKED_COMMIT})")
    if goldens.stand_ins:
        print(f"absent, stand-ins during the import for the goldens' unused imports: {', '.join(goldens.stand_ins)}")
    for op, reason in goldens.errors.items():
        print(f"cannot import the {op} golden: {reason}")
    start, rows = time.perf_counter(), []
    for index, op, name, params in selected:
        if op in goldens.modules:
            rows += run_case(goldens.modules[op], op, index, name, params)
    print_table(rows)
    bad = sum(r.verdict != "AGREE" for r in rows)
    print(f"{len(rows) - bad} of {len(rows)} outputs agree in {time.perf_counter() - start:.1f} s"
          + (f"; {len(goldens.errors)} golden module(s) not imported" if goldens.errors else ""))
    return 1 if bad or goldens.errors else 0
