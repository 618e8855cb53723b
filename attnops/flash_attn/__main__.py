"""``python -m attnops.flash_attn SCRIPT [ARGS...]``: run an unmodified flash-attn script on attnops (after
:func:`attnops.flash_attn.install`), on the CPU or a CUDA GPU."""
import runpy
import sys

from .shim import install

if len(sys.argv) < 2:
    sys.exit("usage: python -m attnops.flash_attn SCRIPT [ARGS...]")
install()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
