"""Run a peer project's own tests, unmodified, against attnops on the CPU, and print a table per test function and
file. ``--flash-attn DIR``: a flash-attn checkout, two suites: flash-attn 2 (tests/test_flash_attn.py,
tests/test_rotary.py, tests/layers/test_rotary.py) and FA3 (hopper/test_*.py) through attnops.flash_attn, with CUDA
devices mapped to the CPU. ``--op-plugin DIR``: an op-plugin checkout (the test/test_custom_ops files on attention,
KV caches, ATB, NSA, DSA and MLA) through attnops.torch_npu, reporting the SoC ``--npu-soc``.
Cases too large for the CPU are deselected by a size rule and a seeded sample of --sample cases per test function
runs; exclusions are listed with their reasons (docs/peer_tests.md)."""
from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import tempfile
from pathlib import Path

from .._core.checks import require
from .._core.errors import ParamInvalidError
from .exclusions import EXCLUDED, EXCLUDED_FILES
from .plugin import PeerTestsPlugin
from .report import table
from .sizes import DESCRIPTION as SIZE_RULE
from .suites import SUITES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--flash-attn", metavar="DIR", type=Path, help="a flash-attn source checkout")
    parser.add_argument("--op-plugin", metavar="DIR", type=Path, help="an Ascend op-plugin source checkout")
    parser.add_argument("--npu-soc", metavar="SOC",
                        help="the Ascend SoC torch_npu reports to op-plugin's tests (SupportedDevices), e.g. "
                             "Ascend910B1 (default: $ATTNOPS_NPU_SOC, else Ascend910B1)")
    parser.add_argument("--sample", metavar="N", type=int, default=3,
                        help="cases per test function, a seeded sample of those that fit (default 3; 0: all)")
    parser.add_argument("--seed", metavar="S", type=int, default=0, help="the sampling seed (default 0)")
    parser.add_argument("--select", metavar="REGEX", nargs="+",
                        help="run only the test functions whose 'file::function' id matches one of these regular "
                             "expressions (re.search)")
    parser.add_argument("--pytest-args", metavar="ARGS", default="",
                        help="further pytest arguments, split as a shell does (give them with '=': "
                             "--pytest-args='-x --tb=long')")


def run_suite(name: str, root: Path, sample: int | None, seed: int, select: tuple[str, ...] | None = None,
              extra: tuple[str, ...] = (), options: dict | None = None) -> tuple[int, PeerTestsPlugin]:
    """Run suite ``name`` of the checkout ``root`` in this process (in a temporary working directory: some tests
    write files); returns pytest's exit code and the plugin holding the outcomes. ``options``: the suite's
    settings (``npu_soc``)."""
    import pytest

    suite = SUITES[name]
    root = root.resolve()
    files = [root / name for name in suite.files(root) if (root / name).is_file()]
    require(bool(files), f"--{name}", f"a {name} checkout with its test files", str(root))
    for directory in dict.fromkeys(str(path.parent) for path in files):  # sibling imports, as pytest's default
        if directory not in sys.path:
            sys.path.insert(0, directory)
    plugin = PeerTestsPlugin(sample, seed, select)
    plugin.excluded_files = {file: reason for file, reason in EXCLUDED_FILES.items() if (root / file).is_file()
                             and file.rsplit("/", 1)[0] in {str(path.parent.relative_to(root)) for path in files}}
    with tempfile.TemporaryDirectory() as tmp, suite.installed(options or {}), contextlib.chdir(tmp):
        ini = Path(tmp) / "pytest.ini"
        ini.write_text("[pytest]\n")  # not the peer's nor attnops' configuration
        args = [*map(str, files), "--rootdir", str(root), "-c", str(ini), "-p", "no:cacheprovider",
                "-p", "no:xdist", "--import-mode=importlib", "--continue-on-collection-errors", "-q", *extra]
        code = pytest.main(args, plugins=[plugin])
    return int(code), plugin


def run(args: argparse.Namespace) -> int:
    roots = {"flash-attn": args.flash_attn, "fa3": args.flash_attn, "op-plugin": args.op_plugin}
    chosen = {name: root for name, root in roots.items() if root is not None}
    if not chosen:
        print("peer-tests: give --flash-attn DIR and/or --op-plugin DIR", file=sys.stderr)
        return 2
    status = 0
    for name, root in chosen.items():
        if SUITES[name].optional and not any((root / file).is_file() for file in SUITES[name].files(root)):
            print(f"== {name} suite: no test files in {root}, not run")
            continue
        print(f"== {name} suite: {root}")
        for note in SUITES[name].notes + (SIZE_RULE, f"sample: {args.sample or 'all'} cases per test function, "
                                                    f"seed {args.seed}", f"exclusions: {len(EXCLUDED)} test "
                                                    f"functions and {len(EXCLUDED_FILES)} files listed"):
            print(f"  {note}")
        try:
            code, plugin = run_suite(name, root, args.sample or None, args.seed, tuple(args.select or ()),
                                     tuple(shlex.split(args.pytest_args)), {"npu_soc": args.npu_soc})
        except ParamInvalidError as error:
            print(f"peer-tests: {error}", file=sys.stderr)
            return 2
        print(f"\n== {name} results\n{table(plugin)}")
        status = status or (0 if code in (0, 5) and not plugin.collection_errors else 1)
    return status
