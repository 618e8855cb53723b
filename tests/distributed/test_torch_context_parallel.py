"""attnops' FlashAttention and PyTorch's CPU SDPA inside PyTorch's ``context_parallel()`` on CPU Gloo at world
sizes 2 and 4 (cases in ``_torch_cp_cases``, run by the session fixtures of ``conftest.py``), and the example script
as a user runs it under torchrun."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed._torch_cp_cases import torch_cp_checks
from tests.distributed.test_context_parallel import _check

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", [name for name, _ in torch_cp_checks(2)])
def test_world2(modes_world2, name):
    _check(modes_world2, name)


@pytest.mark.parametrize("name", [name for name, _ in torch_cp_checks(4)])
def test_world4(modes_world4, name):
    _check(modes_world4, name)


# slow: one run in a few aborts after printing its correct results ("terminate called without an active
# exception" in a rank's interpreter teardown); the spawned cases above check the same calls on every run
@pytest.mark.slow
def test_unmodified_script_under_torchrun():
    """``torchrun --nproc-per-node 2 examples/context_parallel_sdpa.py``: SDPA and torch_npu's fusion attention in
    a model inside ``context_parallel()`` match the single-device run (the script checks and exits non-zero)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "examples/context_parallel_sdpa.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert res.stdout.count("matches one device") == 2, res.stdout
