"""``attnops.flash_attn.install()``: every module name code imports resolves to attnops (tests/docs runs the
unmodified flash-attn script examples/flash_attn_example.py, which checks itself against an fp64 reference, through
``python -m attnops.flash_attn``); nothing is installed where a real flash_attn is importable.
Each case in a fresh interpreter (install changes the import system for the process)."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*args, cwd=ROOT, **env):
    result = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(ROOT), "PATH": "", **env})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_module_names_resolve_to_attnops():
    out = _run("-c", """
import sys
import torch
import attnops.flash_attn
assert attnops.flash_attn.install() is True
import flash_attn, flash_attn_interface
from flash_attn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func
import flash_attn.layers
from flash_attn.ops.triton.rotary import apply_rotary
assert apply_rotary is attnops.flash_attn.ops.triton.rotary.apply_rotary
assert flash_attn is attnops.flash_attn and flash_attn_interface is attnops.flash_attn.fa3
assert flash_attn.flash_attn_interface.flash_attn_func is flash_attn_func is attnops.flash_attn.flash_attn_func
try:
    import flash_attn.no_such_module
    sys.exit("imported a module that does not exist")
except ModuleNotFoundError:
    pass
q = torch.randn(1, 8, 2, 16)
assert torch.equal(flash_attn_func(q, q, q, causal=True), attnops.flash_attn.flash_attn_func(q, q, q, causal=True))
print("ok")
""")
    assert out.strip() == "ok"


def test_real_package_wins(tmp_path):
    for name in ("flash_attn", "flash_attn_interface"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("REAL = True\n")
    out = _run("-c", """
import attnops.flash_attn
assert attnops.flash_attn.install() is False
import flash_attn, flash_attn_interface
print(flash_attn.REAL and flash_attn_interface.REAL)
""", cwd=tmp_path)
    assert out.strip() == "True"


def test_force_installs_over_the_real_package(tmp_path):
    """``install(force=True)`` (the peer-test runner's): the stand-ins even where the real packages are importable."""
    for name in ("flash_attn", "flash_attn_interface"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("REAL = True\n")
    out = _run("-c", """
import attnops.flash_attn
assert attnops.flash_attn.install(force=True) is True
import flash_attn, flash_attn_interface
print(flash_attn is attnops.flash_attn and flash_attn_interface is attnops.flash_attn.fa3)
""", cwd=tmp_path)
    assert out.strip() == "True"
