"""``python -m attnops aot``: every operator's registered kernels compile ahead of time (one small kernel on both
targets here; ``tests/ops/flash_attention/triton/test_gpu_compile.py`` covers the FA kernels' configurations)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_aot_all_targets_one_kernel():
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="1")
    run = subprocess.run([sys.executable, "-m", "attnops", "aot", "--target", "all", "--filter", "fp16-d64-causal",
                          "--kernel", "preprocess"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.startswith("flash_attention ")]
    assert {r[2] for r in rows} == {"sm_90", "sm_80"} and all(r[-1] == "ok" for r in rows)
    assert "0 failure(s)" in run.stdout


def test_aot_rejects_unknown_case():
    run = subprocess.run([sys.executable, "-m", "attnops", "aot", "--filter", "no-such-case"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "no AOT case matches" in run.stderr
