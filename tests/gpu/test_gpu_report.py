"""``python -m attnops gpu-report``: the peak table, the GPU suite registry, the refusal without CUDA, a hanging
step killed at its budget, and the whole ``--interpret --quick`` flow (Triton's interpreter on the CPU)."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnops.gpu import report
from attnops.gpu.peaks import peak_for
from attnops.gpu.suites import GPU_SUITES, GpuSuite, register_gpu_suite

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name,model", [("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
                                        ("NVIDIA H200", "H200 SXM"), ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB")])
def test_known_peaks(name, model):
    assert peak_for(name).model == model and peak_for(name).bf16_tflops > 0 and peak_for(name).hbm_gbps > 0


def test_unknown_gpu_has_unknown_peaks():
    peak = peak_for("NVIDIA GeForce RTX 4090")
    assert peak.bf16_tflops is None and "unknown" in peak.describe()


def test_gpu_suites_registry():
    from attnops.bench import SUITES

    assert "fa-gpu" in GPU_SUITES
    for s in GPU_SUITES.values():
        assert SUITES[s.suite].device == "cuda" and s.smoke_suite in SUITES
    with pytest.raises(ValueError, match="already registered"):
        register_gpu_suite(GpuSuite("fa-gpu", "fa-smoke", "x"))


def test_memory_bound_rate_uses_bytes():
    case = dict(dtype="bfloat16", batch=2, heads=4, kv_heads=1, sq=1, skv=100, d=8, dv=8)
    assert report.bytes_moved(case) == 2 * (2 * 1 * 4 * 16 + 2 * 100 * 1 * 16)
    int8_kv = dict(case, params={"kv": "int8"})
    assert report.bytes_moved(int8_kv) == 2 * 2 * 1 * 4 * 16 + 2 * 100 * 1 * 16


def test_default_output_folder_is_in_the_current_directory():
    assert report.parser().parse_args([]).out == "attnops-gpu-report"
    assert report.parser().parse_args(["--out", "elsewhere"]).out == "elsewhere"


def test_hanging_step_is_killed_at_its_budget(tmp_path):
    code = "import time; print('started', flush=True); time.sleep(60); print('finished', flush=True)"
    step = report.Step("hang", [sys.executable, "-c", code], budget_s=2)
    report.run_step(step, tmp_path, "t")
    assert step.status == "TIMEOUT" and "started" in step.tail and "finished" not in step.tail


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_without_cuda():
    run = subprocess.run([sys.executable, "-m", "attnops", "gpu-report"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr and "--interpret" in run.stderr


def test_interpret_quick_flow(tmp_path):
    """The whole flow through the interpreter (about 1.5 min on 2 CPU cores): every step passes, the summary and
    the benchmark JSON are written."""
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, "-m", "attnops", "gpu-report", "--interpret", "--quick", "--out",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    (md,) = tmp_path.glob("gpu-report-interpret-*.md")
    text = md.read_text()
    assert "| tests | pass |" in text and "| check | pass |" in text
    for suite in GPU_SUITES.values():
        assert f"| bench-{suite.suite} | pass |" in text
        assert list(tmp_path.glob(f"{suite.smoke_suite}-cpu-*.json"))
