"""Command line: ``python -m attnops {check,bench,compare,huawei-goldens,build-kernels,gpu-report,aot} [options]``;
``python -m attnops COMMAND --help`` for details."""
from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__

# command -> (module with add_arguments(parser) and run(args), one-line description)
COMMANDS = {
    "check": ("attnops.check", "run every operator on every available backend against the fp64 golden "
                               "(prints which backends ran and why any was skipped)"),
    "bench": ("attnops.bench.runner", "time the operators against PyTorch baselines (without --suite: list the "
                                      "benchmark suites)"),
    "compare": ("attnops.msprobe.cli", "judge the fused-attention calls of a msprobe dump from an NPU against the "
                                       "fp64 golden and the NPU-precision emulation (docs/compare.md)"),
    "huawei-goldens": ("attnops.check.huawei_goldens", "attnops' DeepSeek-V4 operators side by side with Huawei's CPU "
                                                      "goldens from an ops-transformer checkout (docs/dsv4.md)"),
    "build-kernels": ("attnops.ops.common.cpu_kernels_cli", "build the CPU decode kernel ahead of time and print where "
                                                       "it is"),
    "peer-tests": ("attnops.peer_tests.cli", "run a flash-attn or op-plugin checkout's own tests against attnops on "
                                             "the CPU, sampled, and print a table per test function "
                                             "(docs/peer_tests.md)"),
}
# command -> (module with main(argv), one-line description)
OWN_PARSER = {
    "gpu-report": ("attnops.gpu.report", "validate and time every GPU path in one run within --budget: CUDA "
                                         "tests, check, GPU benchmarks (docs/gpu.md; --interpret runs it on the CPU)"),
    "aot": ("attnops._core.triton.cli", "compile every Triton kernel ahead of time for sm_80/sm_90 (no GPU needed) "
                                        "and print registers, spills and shared memory"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command; only ``command``'s module is imported for its options (the others' imports,
    heavy for some, would only cost start-up time)."""
    parser = argparse.ArgumentParser(
        prog="python -m attnops", description="attnops: Huawei CANN's fused-attention operators on PyTorch.",
        epilog="Run 'python -m attnops COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"attnops {__version__}")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    for name, (module_name, summary) in COMMANDS.items():
        if name != command:
            commands.add_parser(name, help=summary)
            continue
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=summary, description=module.__doc__.replace("``", ""),
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    for name, (_, summary) in OWN_PARSER.items():
        commands.add_parser(name, help=summary + f"; 'python -m attnops {name} --help' for its options",
                            add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in OWN_PARSER:  # commands that parse their own arguments
        return importlib.import_module(OWN_PARSER[argv[0]][0]).main(argv[1:])
    parser = build_parser(next((a for a in argv if a in COMMANDS), None))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
