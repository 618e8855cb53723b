"""Quick tests of ``python -m attnops check`` itself: backend selection, the judge, crash rows, case backends."""
from __future__ import annotations

import importlib.util
import os
import sys

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


def test_flash_attention_and_fia_cases_run_on_triton():
    on_triton = {c.operator for c in check.all_cases() if "triton" in c.backends}
    fa = {"flash_attention_score(+_grad)", "flash_attention_var_len_score / unpadding_grad",
          "flash_attention_var_len_score_v2 / unpadding_grad_v2", "attnops.flash_attention"}
    flash_attn = {c.operator for c in check.all_cases() if c.operator.startswith("attnops.flash_attn.")}
    helpers = {op for op in flash_attn if ".layers." in op or op.endswith(".bert_padding")}  # plain PyTorch
    fia = {"fused_infer_attention_score_v2", "attnops.fused_infer_attention"}
    assert on_triton == fa | (flash_attn - helpers) | fia
    reference_only = {c.name for c in check.all_cases() if "triton" not in c.backends and c.operator in fa}
    bf16 = set() if torch.cuda.is_available() else {"SBH GQA 4 mode 3 bf16"}  # the interpreter has no bf16
    assert reference_only == {"TND V2 sqrt ALiBi pse_type 3, D=640"} | bf16  # head dims up to 256


def test_list_prints_every_case_without_running(capsys):
    assert check.main(["--list", "--filter", "npu_"]) == 0
    lines = capsys.readouterr().out.splitlines()
    from attnops.check import dsa as dsa_cases
    from attnops.check import dsv4 as dsv4_cases
    from attnops.check import torch_npu as npu_cases
    from attnops.check import torch_npu_atb as atb_cases
    dsa_npu = [c for c in dsa_cases.cases() + dsv4_cases.cases() if "npu_" in c.operator]
    assert len(lines) == len(npu_cases.cases()) + len(atb_cases.cases()) + len(dsa_npu)
    assert all(line.startswith(("npu_", "_npu_", "_C_ascend.npu_")) and line.endswith("reference") for line in lines)


def test_triton_skip_reasons(monkeypatch):
    monkeypatch.setattr(check, "triton_runs_on_cuda", lambda: False)
    monkeypatch.delenv("ATTNOPS_TRITON_INTERPRET", raising=False)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "triton", None)  # find_spec: not installed
        assert check.triton_skip_reason() == "Triton is not installed; pip install triton"
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    assert check.triton_skip_reason() == ("no CUDA device; set ATTNOPS_TRITON_INTERPRET=1 to run the Triton kernels "
                                          "in Triton's CPU interpreter")
    monkeypatch.setenv("ATTNOPS_TRITON_INTERPRET", "1")
    assert check.triton_skip_reason() is None


def _fake_cases():
    ok = lambda backend: []  # noqa: E731 - a case with nothing to compare passes
    return [CheckCase("op_a", "fast case", ok, ("reference", "triton")), CheckCase("op_b", "other", ok)]


def test_report_says_which_backends_ran_and_why_one_was_skipped(monkeypatch, capsys):
    monkeypatch.setattr(check, "all_cases", _fake_cases)
    monkeypatch.setattr(check, "triton_skip_reason", lambda: "no CUDA device; set ATTNOPS_TRITON_INTERPRET=1")
    monkeypatch.setattr(check.cpu_kernels, "status", lambda: "pure PyTorch (no C++ compiler found)")
    monkeypatch.setattr(check.cpu_kernels, "location", lambda: None)
    monkeypatch.setattr(check.bf16_gemm, "bf16_gemm", lambda device: False)
    assert check.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["reference: runs 2 of 2 cases; CPU decode (FIA, NSA): pure PyTorch (no C++ compiler found); "
                       "CPU bf16 products: fp32",
                       "triton: skipped (no CUDA device; set ATTNOPS_TRITON_INTERPRET=1)"]
    assert out[-1].startswith("2 passed, 0 failed in") and out[-1].endswith("(backends: reference)")
    monkeypatch.setattr(check, "triton_skip_reason", lambda: None)
    monkeypatch.setattr(check, "triton_runs_on_cuda", lambda: False)
    assert check.main(["--filter", "OP_"]) == 0  # the filter ignores case
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["reference: runs 2 of 2 cases; CPU decode (FIA, NSA): pure PyTorch (no C++ compiler found); "
                       "CPU bf16 products: fp32",
                       "triton: runs 1 of 2 cases in Triton's CPU interpreter; the others run on the reference only"]
    assert out[-1].endswith("(backends: reference, triton)")


def test_report_names_the_cpu_decode_library_in_use(monkeypatch, capsys):
    """... and the unit the bf16 products of the CPU FlashAttention engine run on."""
    monkeypatch.setattr(check, "all_cases", _fake_cases)
    monkeypatch.setattr(check.bf16_gemm, "bf16_gemm", lambda device: True)
    monkeypatch.setattr(check.bf16_gemm, "unit", lambda: "AMX-BF16")
    monkeypatch.setattr(check, "triton_skip_reason", lambda: "no CUDA")
    monkeypatch.setattr(check.cpu_kernels, "status", lambda: "compiled C++ kernel")
    monkeypatch.setattr(check.cpu_kernels, "location", lambda: "/cache/k.so (CPU x86_64 avx2 #0; g++ 12)")
    assert check.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == ["reference: runs 2 of 2 cases; CPU decode (FIA, NSA): compiled C++ kernel; CPU bf16 products: "
                       "AMX-BF16",
                       "CPU decode library: /cache/k.so (CPU x86_64 avx2 #0; g++ 12)", "triton: skipped (no CUDA)"]


def test_a_filter_that_matches_nothing_is_an_error_listing_the_cases(monkeypatch, capsys):
    monkeypatch.setattr(check, "all_cases", _fake_cases)
    monkeypatch.setattr(check, "triton_skip_reason", lambda: "no CUDA")
    for argv in (["--filter", "nothing"], ["--list", "--filter", "nothing"]):
        assert check.main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.splitlines() == [
            "python -m attnops check: error: --filter 'nothing' matches no case; the cases (operator | case | "
            "backends, as --list prints them) are:", "op_a  |  fast case  |  reference", "op_b  |  other  |  reference"]
