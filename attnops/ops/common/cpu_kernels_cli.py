"""Build the CPU decode kernel ahead of time (for this CPU, compiler and environment: CXX, CXXFLAGS,
ATTNOPS_CPU_ARCH, ATTNOPS_CACHE_DIR) and print where the library is, the CPU tag it was built for and whether it was
built now or already cached. Exits 1 when it can be neither built nor loaded."""
from __future__ import annotations

import argparse
import os
import shlex
import sys

from .cpu_kernels import open_library


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: the environment chooses the build."""


def run(args: argparse.Namespace) -> int:
    try:
        opened = open_library()
    except Exception as e:  # every reason the kernel is unavailable is reported, none is raised
        print(f"CPU decode kernel: cannot be built or loaded: {e}", file=sys.stderr)
        return 1
    recipe = opened["recipe"]
    print(f"CPU decode kernel: {'built' if opened['built'] else 'already cached'}: {opened['path']}")
    print(f"CPU tag: {recipe.cpu}")
    print(f"compiler: {shlex.join(recipe.command)} ({recipe.compiler}); flags: {' '.join(recipe.flags)}")
    if os.environ.get("ATTNOPS_CPU_KERNELS", "1") == "0":
        print("note: ATTNOPS_CPU_KERNELS=0 keeps the library unused at run time")
    return 0
