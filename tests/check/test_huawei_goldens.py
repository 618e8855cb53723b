"""``python -m attnops huawei-goldens``: the verdict rule, the loader's reports, and (slow, with a checkout named by
ATTNOPS_OPS_TRANSFORMER) the whole side-by-side run against Huawei's CPU goldens."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnops.__main__ import main
from attnops.check.huawei_goldens import ENV
from attnops.check.huawei_goldens.loader import GOLDEN_FILES, load
from attnops.check.huawei_goldens.verdict import exact, judge

ROOT = Path(__file__).resolve().parents[2]


def _judge(attnops_err: float, huawei_err: float):
    golden = torch.zeros(4, dtype=torch.float64)
    return judge("op", "case", "out", torch.full((4,), attnops_err), torch.full((4,), huawei_err), golden,
                 reduction=1)


def test_verdict_names_the_side_outside_the_bound():
    assert _judge(0.01, 0.012).verdict == "AGREE"
    assert _judge(0.01, 5.0).verdict == "HUAWEI OFF"
    assert _judge(5.0, 0.01).verdict == "ATTNOPS OFF"
    assert exact("op", "case", "idx", 0).verdict == "AGREE" and exact("op", "case", "idx", 2).verdict == "DIFFER"


def test_missing_golden_files_are_reported_by_name(tmp_path):
    goldens = load(tmp_path)
    assert not goldens.modules
    assert sorted(goldens.errors) == sorted(GOLDEN_FILES)
    assert all(f"{GOLDEN_FILES[op]} not found" in reason for op, reason in goldens.errors.items())


def test_without_a_checkout_the_command_says_how_to_name_one(monkeypatch, capsys):
    monkeypatch.delenv(ENV, raising=False)
    assert main(["huawei-goldens"]) == 2
    assert f"pass --ops-transformer DIR or set {ENV}" in capsys.readouterr().err


@pytest.mark.slow
def test_attnops_agrees_with_huaweis_goldens():
    checkout = os.environ.get(ENV)
    if not checkout:
        pytest.skip(f"{ENV} is not set: point it at a checkout of ops-transformer (git clone of "
                    "cannmirror/ops-transformer) to compare with Huawei's DeepSeek-V4 CPU goldens")
    r = subprocess.run([sys.executable, "-m", "attnops", "huawei-goldens", "--ops-transformer", checkout],
                       capture_output=True, text=True, cwd=ROOT, timeout=3600)
    assert "cannot import" not in r.stdout, r.stdout
    assert r.returncode == 0, r.stdout[-20000:] + r.stderr[-5000:]
    assert r.stdout.count("AGREE") >= 100
