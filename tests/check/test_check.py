"""Quick tests of ``python -m attnops check`` itself: backend selection, the judge, crash rows, case backends."""
from __future__ import annotations

import os

import pytest
import torch

import attnops.check as check
from attnops.check import CheckCase, Comparison, available_backends, backend_env, run_case


def test_triton_backend_only_when_its_kernels_can_run(monkeypatch):
    monkeypatch.setattr(check, "triton_runs_on_cuda", lambda: False)
    monkeypatch.delenv("ATTNOPS_TRITON_INTERPRET", raising=False)
    assert available_backends() == ["reference"]
    pytest.importorskip("triton")
    monkeypatch.setenv("ATTNOPS_TRITON_INTERPRET", "1")
    assert available_backends() == ["reference", "triton"]


def test_backend_env_is_set_for_the_case_and_restored(monkeypatch):
    monkeypatch.setenv("ATTNOPS_BACKEND", "auto")
    seen = []
    row = run_case(CheckCase("op", "case", lambda b: seen.append(os.environ["ATTNOPS_BACKEND"]) or []), "reference")
    assert seen == ["reference"] and row.ok and os.environ["ATTNOPS_BACKEND"] == "auto"
    monkeypatch.delenv("ATTNOPS_BACKEND")
    with backend_env("triton"):
        assert os.environ["ATTNOPS_BACKEND"] == "triton"
    assert "ATTNOPS_BACKEND" not in os.environ


def test_judge_fails_a_result_beyond_the_bound_and_a_crash():
    golden = torch.linspace(-1, 1, 64, dtype=torch.float64)
    baseline = golden.to(torch.float16)
    good = Comparison("x", golden.to(torch.float16), golden, baseline)
    bad = Comparison("x", (golden + 0.01).to(torch.float16), golden, baseline)
    assert run_case(CheckCase("op", "good", lambda b: [good]), "reference").ok
    row = run_case(CheckCase("op", "bad", lambda b: [good, bad]), "reference")
    assert not row.ok and "x: err" in row.detail

    def crash(_backend):
        raise ValueError("boom")

    row = run_case(CheckCase("op", "crash", crash), "reference")
    assert not row.ok and row.detail == "ValueError: boom"


def test_only_flash_attention_cases_run_on_triton():
    on_triton = {c.operator for c in check.all_cases() if "triton" in c.backends}
    assert on_triton == {"flash_attention_score(+_grad)", "flash_attention_var_len_score / unpadding_grad",
                         "flash_attention_var_len_score_v2 / unpadding_grad_v2", "attnops.flash_attention"}
    reference_only = {c.name for c in check.all_cases() if "triton" not in c.backends and c.operator in on_triton}
    bf16 = set() if torch.cuda.is_available() else {"SBH GQA 4 mode 3 bf16"}  # the interpreter has no bf16
    assert reference_only == {"TND V2 sqrt ALiBi pse_type 3, D=640"} | bf16  # head dims up to 256


def test_list_prints_every_case_without_running(capsys):
    assert check.main(["--list", "--filter", "npu_"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 16 and all(line.startswith("npu_") and line.endswith("reference") for line in lines)
